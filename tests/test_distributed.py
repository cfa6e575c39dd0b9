"""The distributed environment (distributed.py): Paddle's flags banner is kept out of the logs; the gradient buckets."""

from __future__ import annotations

import io

import paddle
import pytest

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
