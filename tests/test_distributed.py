"""The distributed environment (distributed.py): Paddle's flags banner is kept out of the logs; the gradient buckets;
rank 0's word after work it does alone."""

from __future__ import annotations

import io
import subprocess
import sys

import paddle
import pytest
from helpers import explain, launch_env, worker_log

from paddle_mnist.network import models
from paddle_mnist.runtime import distributed


def test_the_flags_banner_is_dropped_unless_it_names_a_flag_the_user_set():
    banner = [f"{distributed.BANNER} ===\n", "FLAGS(name='FLAGS_enable_pir_in_executor', ...)", "\n", "=" * 71 + "\n"]
    for user, kept in ((set(), False), ({"FLAGS_check_nan_inf"}, False), ({"FLAGS_enable_pir_in_executor"}, True)):
        out = io.StringIO()
        filtered = distributed._BannerFilter(out, user)
        for text in ["before\n", *banner, "after\n"]:
            filtered.write(text)
        assert out.getvalue() == "before\n" + ("".join(banner) if kept else "") + "after\n"


@pytest.mark.parametrize("name", ["mnist_cnn_bn_fc", "cifar_cnn", "minigooglenet"])
def test_gloo_reduces_every_gradient_in_one_bucket_and_nccl_in_several(name):
    """The buckets DataParallel forms from buckets(), by Paddle's own grouping (what DataParallel calls): one on the
    CPU, where gloo's all-reduce overlaps nothing (docs/performance.md); several with NCCL, to overlap backward."""
    model = models.build_model(name, 10, (3, 32, 32))
    trained = [p for p in model.parameters() if not p.stop_gradient]

    def groups(backend: str) -> list:
        comm, last = distributed.buckets(model, distributed.DistEnv(0, 2, 0, 2, backend, "cpu"))
        limits = [int(last * 1024 * 1024), int(comm * 1024 * 1024)]  # as DataParallel converts them
        return paddle.base.core.eager_assign_group_by_size(trained, [False] * len(trained), limits)

    gloo, nccl = groups("gloo"), groups("nccl")
    assert len(gloo) == 1 and sorted(gloo[0]) == list(range(len(trained))), gloo
    assert len(nccl) > 1, nccl


# Two workers under the launcher: rank 0 works alone for argv[1] seconds, then gives its word (7); the other waits up
# to argv[2] seconds for it. Both then meet in a barrier, as the trainer's ranks do after the export.
WORD = r"""
import sys, time
from paddle_mnist.runtime import distributed
env = distributed.setup()
if env.is_main:
    time.sleep(float(sys.argv[1]))
try:
    print("word", distributed.word_from_main(env, "the test's work", 7, float(sys.argv[2])), flush=True)
except RuntimeError as e:
    print(f"error: {e}", flush=True)
    sys.exit(1)
distributed.barrier(env)
"""


@pytest.mark.slow
def test_rank_0s_word_outlasts_a_collectives_30_s_and_a_late_one_is_named(tmp_path):
    """The export's wait: rank 0 alone for 33 s, longer than gloo's abort and the shared-memory sum's deadline (the
    failure it replaced: the other rank gave up at 30 s while rank 0 exported on a busy machine); then a word that
    does not come within the patience is an error naming rank 0."""
    script = tmp_path / "word.py"
    script.write_text(WORD)
    for alone_s, patience_s, ok in ((33, 120, True), (8, 2, False)):
        log_dir = tmp_path / f"log{alone_s}"
        cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir", str(log_dir)]
        cmd += [str(script), str(alone_s), str(patience_s)]
        job = subprocess.run(cmd, cwd=tmp_path, env=launch_env(), capture_output=True, text=True, timeout=180)
        assert (job.returncode == 0) == ok, explain(job, log_dir)
        if ok:
            assert "word 7" in worker_log(log_dir, 1) and "word 7" in worker_log(log_dir, 0)
        else:
            assert "error: waited 2 s for rank 0 to finish the test's work alone; it did not finish" in worker_log(
                log_dir, 1
            ), explain(job, log_dir)
