"""The docs' shape: README lines a reader can see whole, docs pages short enough to read, and the recipe table of
docs/training.md equal to the recipes the code runs."""

from __future__ import annotations

import re
from pathlib import Path

from paddle_mnist.config import PER_WORKER_BATCH, RECIPES

ROOT = Path(__file__).resolve().parent.parent
README_WIDTH = 200  # characters a README line may hold, table rows and commands included
PAGE_LINES = 400  # lines a page of docs/ may hold: past it, the page splits (as training.md did into runs.md)


def long_lines(text: str, width: int) -> list[str]:
    """Each line over `width` characters, as "line N: M characters"."""
    return [f"line {n}: {len(line)} characters" for n, line in enumerate(text.splitlines(), 1) if len(line) > width]


def long_pages(pages: dict[str, str], most: int) -> list[str]:
    """Each page over `most` lines, as "NAME: N lines"."""
    return [f"{name}: {text.count(chr(10))} lines" for name, text in pages.items() if text.count("\n") > most]


def test_the_length_checks_name_what_is_too_long():
    assert long_lines("short\n" + "x" * 201 + "\n" + "y" * 200 + "\n", 200) == ["line 2: 201 characters"]
    pages = {"a.md": "one\n" * 401, "b.md": "one\n" * 400}
    assert long_pages(pages, 400) == ["a.md: 401 lines"]


def test_no_readme_line_is_wider_than_200_characters():
    found = long_lines((ROOT / "README.md").read_text(), README_WIDTH)
    assert found == [], f"README.md has lines over {README_WIDTH} characters (split or shorten them): {found}"


def test_no_docs_page_is_longer_than_400_lines():
    pages = {p.name: p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))}
    assert len(pages) > 10, sorted(pages)
    found = long_pages(pages, PAGE_LINES)
    assert found == [], f"docs pages over {PAGE_LINES} lines (split them or cut what is said twice): {found}"


def recipe_rows(text: str) -> dict[str, list[str]]:
    """The rows of docs/training.md's table under "## Recipes by model": model -> its cells after the first."""
    section = text.split("## Recipes by model", 1)[1].split("\n#", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        match = re.fullmatch(r"`(\w+)`( \(default\))?", cells[0]) if line.startswith("|") else None
        if match:
            rows[match.group(1)] = cells[1:]
    return rows


def test_the_recipe_table_in_the_training_docs_is_the_code_s():
    rows = recipe_rows((ROOT / "docs" / "training.md").read_text())
    assert list(rows) == list(RECIPES), "docs/training.md's recipe table: one row per model, in RECIPES' order"
    for model, recipe in RECIPES.items():
        lr, warmup, epochs, decay, batch = rows[model]
        written = (float(lr), float(warmup), int(epochs), float(decay), batch)
        expected = (recipe.lr, recipe.warmup_epochs, recipe.epochs, recipe.weight_decay)
        expected += (str(recipe.batch_size) if recipe.batch_size else f"{PER_WORKER_BATCH} x workers",)
        assert written == expected, f"docs/training.md's recipe for {model}: {written}, the code's {expected}"
