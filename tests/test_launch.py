"""Launch facts and device checks (launch.py): each launcher's layout, GPUs per node, --selected_gpus, AMP support."""

from __future__ import annotations

import pytest

from paddle_mnist.runtime import launch


def test_more_workers_than_gpus_is_refused_with_the_fix():
    """The GPU check's logic; the GPU path itself cannot run on these CPU-only machines."""
    assert launch.gpu_shortfall(4, 4) is None and launch.gpu_shortfall(2, 8) is None
    message = launch.gpu_shortfall(4, 2)
    assert "4 workers were started on this node but only 2 GPU(s) are visible" in message
    assert "list at most 2 of the visible GPUs' labels in --gpus" in message


def test_the_legacy_launchers_two_machine_layout_counts_this_machines_workers():
    """fleet.launch (--selected_gpus without --master) on 2 machines x 4 GPUs: no PADDLE_LOCAL_SIZE, and the
    endpoints list all 8 workers (start_local_trainers in paddle/distributed/fleet/launch_utils.py)."""
    endpoints = [f"10.0.0.{m}:{6070 + i}" for m in (1, 2) for i in range(4)]
    worker = {
        "PADDLE_TRAINER_ID": "5",
        "PADDLE_CURRENT_ENDPOINT": "10.0.0.2:6071",
        "PADDLE_TRAINERS_NUM": "8",
        "PADDLE_TRAINER_ENDPOINTS": ",".join(endpoints),
        "PADDLE_RANK_IN_NODE": "1",
        "FLAGS_selected_gpus": "1",
    }
    layout = launch.launch_layout(worker)
    assert layout == launch.Layout(world=8, local_rank=1, local_size=4)
    assert launch.gpu_shortfall(layout.local_size, 4) is None


def test_the_current_launchers_layout_and_no_launcher():
    """paddle.distributed.launch --nnodes 2 --gpus 0,1,2,3 (CollectiveController._build_pod_with_master in
    paddle/distributed/launch/controllers/collective.py), and a plain python train.py."""
    endpoints = [f"10.0.0.{m}:{6070 + i}" for m in (1, 2) for i in range(4)]
    worker = {
        "PADDLE_GLOBAL_SIZE": "8",
        "PADDLE_LOCAL_SIZE": "4",
        "PADDLE_GLOBAL_RANK": "6",
        "PADDLE_LOCAL_RANK": "2",
        "PADDLE_TRAINERS_NUM": "8",
        "PADDLE_TRAINER_ENDPOINTS": ",".join(endpoints),
        "PADDLE_CURRENT_ENDPOINT": "10.0.0.2:6072",
    }
    assert launch.launch_layout(worker) == launch.Layout(world=8, local_rank=2, local_size=4)
    assert launch.launch_layout({}) == launch.Layout(world=1, local_rank=0, local_size=1)
    assert launch.gpu_shortfall(8, 4) is not None  # what the old count (every endpoint) ran into


def test_a_worker_notices_that_master_dropped_selected_gpus():
    launcher = ["python", "-m", "paddle.distributed.launch", "--master", "10.0.0.1:8090", "--nnodes", "2"]
    flag = "--selected_gpus=0,1"
    problem = launch.gpu_request_problem(flag, [*launcher, flag, "train.py"], local_size=8)
    assert "ignores --selected_gpus" in problem and "--gpus 0,1" in problem and "8 worker(s)" in problem
    assert launch.gpu_request_problem(flag, ["python", "-m", "paddle.distributed.launch", flag], 2) is None
    assert launch.gpu_request_problem("--gpus 0,1,2,3", [*launcher, "--gpus", "0,1,2,3"], 4) is None
    assert launch.gpu_request_problem(None, launcher, 8) is None


@pytest.mark.parametrize(
    ("amp", "device", "capability", "refused"),
    [
        ("bf16", "gpu:0", (7, 0), "compute capability 8.0 or higher, and gpu:0 has 7.0"),  # V100
        ("bf16", "gpu:1", (7, 5), "use --amp fp16 or --amp off"),  # T4
        ("fp16", "gpu:0", (6, 1), "compute capability 7.0 or higher, and gpu:0 has 6.1"),  # P40
        ("fp16", "cpu", None, "--amp fp16 needs a GPU"),
        ("bf16", "gpu:0", (8, 0), None),  # A100
        ("fp16", "gpu:0", (7, 0), None),
        ("off", "gpu:0", (6, 0), None),
        ("bf16", "cpu", None, "--amp bf16 needs a GPU"),  # auto_cast stays float32 on CPU (test_recipes.py)
    ],
)
def test_amp_problem(amp, device, capability, refused):
    problem = launch.amp_problem(amp, device, capability)
    if refused is None:
        assert problem is None
    else:
        assert refused in problem and "\n" not in problem


def test_a_build_without_code_for_the_card_is_named_with_the_fix():
    """Paddle 2.6's own text for CUDA error 209, as paddlepaddle-gpu 2.6.2 gives it on an H100 (the GPU section of
    docs/results.md); any other error is left to surface as it is."""
    error = OSError("(External) CUDA error(209), no kernel image is available for execution on the device. ")
    message = launch.no_kernel_problem(error, "NVIDIA H100 80GB HBM3", (9, 0))
    assert "has no GPU code for NVIDIA H100 80GB HBM3 (compute capability 9.0)" in message
    assert "paddlepaddle.org.cn" in message and "CUDA_VISIBLE_DEVICES=" in message
    assert launch.no_kernel_problem(RuntimeError("out of memory"), "NVIDIA H100 80GB HBM3", (9, 0)) is None


def test_the_kernel_probe_passes_where_kernels_run_and_names_a_card_without_them():
    """The probe the trainer runs on a GPU at start: on the CPU its kernel runs and it returns; a kernel that fails
    with CUDA error 209 stops with the line naming the card; any other failure surfaces as it is."""
    assert launch.check_gpu_kernels("cpu") is None

    def no_image():
        raise OSError("(External) CUDA error(209), no kernel image is available for execution on the device. ")

    def out_of_memory():
        raise RuntimeError("out of memory")

    h100 = lambda device: ("NVIDIA H100 80GB HBM3", (9, 0))  # noqa: E731 - the card a GPU machine reports
    with pytest.raises(launch.LaunchError, match="has no GPU code for NVIDIA H100 80GB HBM3"):
        launch.check_gpu_kernels("gpu:0", probe=no_image, card=h100)
    with pytest.raises(RuntimeError, match="out of memory"):
        launch.check_gpu_kernels("gpu:0", probe=out_of_memory, card=h100)


def test_help_is_the_launchers_own_only_before_the_training_script():
    """python -m paddle_mnist.launch --help prints what it checks, then Paddle's help (test_packaging runs it);
    train.py --help after the script is the trainer's, for the workers to print."""
    assert launch.asks_for_help(["--help"]) and launch.asks_for_help(["--nnodes", "2", "-h"])
    assert not launch.asks_for_help(["--nproc_per_node", "2", "train.py", "--help"])
    assert not launch.asks_for_help(["--nproc_per_node", "2", "train.py"])
    assert launch.HELP.startswith("usage: python -m paddle_mnist.launch ")
