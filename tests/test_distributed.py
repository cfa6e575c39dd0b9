"""The distributed environment (distributed.py): Paddle's flags banner is kept out of the logs."""

from __future__ import annotations

import io

from paddle_mnist.runtime import distributed


def test_the_flags_banner_is_dropped_unless_it_names_a_flag_the_user_set():
    banner = [f"{distributed.BANNER} ===\n", "FLAGS(name='FLAGS_enable_pir_in_executor', ...)", "\n", "=" * 71 + "\n"]
    for user, kept in ((set(), False), ({"FLAGS_check_nan_inf"}, False), ({"FLAGS_enable_pir_in_executor"}, True)):
        out = io.StringIO()
        filtered = distributed._BannerFilter(out, user)
        for text in ["before\n", *banner, "after\n"]:
            filtered.write(text)
        assert out.getvalue() == "before\n" + ("".join(banner) if kept else "") + "after\n"
