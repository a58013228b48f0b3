"""The calibration's timing helpers on a one-rank gloo group in this process."""

from __future__ import annotations

import time
import weakref

import torch

from stratagem.advisor.calibrate.benchmarks import interleaved, repeated
from stratagem.advisor.calibrate.run import group_sizes
from stratagem.advisor.calibrate.optimizers import (
    HOST_OPTIMIZER_BYTES,
    benchmark_parameters,
    host_optimizer_shape,
    optimizer_seconds,
    small_step_seconds,
)


def test_interleaved_rounds_keep_ratios_on_a_drifting_host(one_rank):
    """Each round runs every function once in turn, so a host that slows down as it goes (here:
    every call sleeps longer than the one before) slows them alike and their ratio holds."""
    calls: list[str] = []

    def work(name: str, seconds: float):
        def run() -> None:
            calls.append(name)
            time.sleep(seconds * (1 + 0.25 * len(calls)))
        return run

    short, long = interleaved([work("short", 0.004), work("long", 0.008)], torch.device("cpu"), repeats=5)
    assert calls == ["short", "long"] * 6  # a warm-up round, then five
    assert 1.6 < long / short < 2.6


def test_a_repeated_run_drops_each_output_before_the_next_call() -> None:
    """A timed run repeats a benchmark thousands of times: holding every output would take tens of
    GB of a GPU, so at most the call in flight keeps one."""
    outputs: list[weakref.ref] = []

    def matmul() -> torch.Tensor:
        assert all(ref() is None for ref in outputs)
        out = torch.ones(8, 8) @ torch.ones(8, 8)
        outputs.append(weakref.ref(out))
        return out

    repeated(matmul, 5)()
    assert len(outputs) == 5 and all(ref() is None for ref in outputs)


def test_optimizer_steps_split_into_a_cost_per_parameter_and_per_tensor(one_rank):
    """torch.optim's AdamW runs 20 tensor passes and 10 operators per tensor where SGD runs 3 and 3:
    both of its costs come out above SGD's."""
    costs = optimizer_seconds(2**18, torch.device("cpu"), repeats=3)
    assert set(costs) == {"adamw", "sgd"}
    (adamw_param, adamw_tensor), (sgd_param, sgd_tensor) = costs["adamw"], costs["sgd"]
    assert adamw_param > sgd_param >= 0 and adamw_tensor > sgd_tensor > 0


def test_the_hosts_step_over_dtensors_costs_more_per_tensor_than_over_plain_tensors(one_rank):
    """An offloaded plan's optimizer steps FSDP's DTensors on the host, one tensor at a time: each
    tensor's ten operators each pass through DTensor's dispatch."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    plain, dtensors = (optimizer_seconds(2**16, torch.device("cpu"), repeats=3, mesh=m)["adamw"] for m in (None, mesh))
    # plain tensors' own cost per tensor can solve to 0 on a busy host (the large step's noise
    # outweighs a few µs a tensor); DTensor's dispatch is tens of µs a tensor
    assert dtensors[1] > 2 * plain[1] and dtensors[1] > 0


def test_the_hosts_parameters_stay_on_the_host_under_a_gpu_mesh() -> None:
    """``calibrate`` times the host's optimizer over DTensors on the GPU mesh, as FSDP2 offloads
    them; ``DTensor.from_local`` would move their shards onto the GPU (format 9 timed an H200's
    "host" step there: 6 ps a parameter). A mesh of CUDA's device type needs no GPU to build; the
    fused kernel steps the host shards under it too."""
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cuda", [0], _init_backend=False, _rank=0)
    (param,) = benchmark_parameters(1, 16, torch.device("cpu"), mesh)
    assert param.to_local().device.type == "cpu" and param.grad.to_local().device.type == "cpu"
    torch.optim.AdamW([param], lr=1e-4).step()
    assert param.shape == (16,) and param.to_local().device.type == "cpu"
    fused = torch.optim.AdamW([param], lr=1e-4, fused=True)  # as the plugins step offloaded shards
    fused.step()
    assert param.to_local().device.type == "cpu" and fused.state[param]["step"].item() == 1


def test_a_dtensor_tensor_costs_a_fraction_on_the_foreach_path_of_what_it_does_one_at_a_time(one_rank):
    """One tensor at a time every DTensor tensor makes its own ten calls; on the foreach path
    (torch.optim's default on GPUs) each call takes all the tensors (a CPU host: 2.4 µs a tensor
    in each against 14 µs a call: ``bench/dtensor_optimizer.py``)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    _, one_at_a_time = small_step_seconds(torch.device("cpu"), repeats=5, mesh=mesh)
    _, foreach = small_step_seconds(torch.device("cpu"), repeats=5, mesh=mesh, foreach=True)
    assert one_at_a_time > 2 * foreach > 0


def test_bytes_move_no_faster_than_a_copy_and_the_floor_is_said() -> None:
    """A busy host can leave the CPU reference step less time than its bytes take at the copy's
    rate (or none: the difference clamps to 0); the copy's rate stands, with a note. Measured above
    it, the measurement stands; unmeasured (GPUs), the copy's rate, without a note."""
    from stratagem.advisor.calibrate.run import COPY_RATE_FLOOR_NOTE, op_byte_seconds_at_least_a_copy

    bandwidth = 50e9
    assert op_byte_seconds_at_least_a_copy(0.0, bandwidth) == (1 / bandwidth, (COPY_RATE_FLOOR_NOTE,))
    assert op_byte_seconds_at_least_a_copy(3 / bandwidth, bandwidth) == (3 / bandwidth, ())
    assert op_byte_seconds_at_least_a_copy(None, bandwidth) == (1 / bandwidth, ())


def test_the_hosts_optimizer_is_timed_over_tensors_larger_than_its_cache():
    """Each tensor of the host's large step is as large as the last-level caches in fp32 (16 bytes a
    parameter with its gradient and AdamW states): 320 MiB of L3 (a large Xeon's) gives two tensors
    of 320 MiB, where the 256 MiB it had timed in eight tensors fit the cache; within an eighth of
    each rank's share of the free memory, and never under 256 MiB in all."""
    tensors, params = host_optimizer_shape(320 * 2**20, 2**40, ranks=8)
    assert (tensors, 4 * params // tensors) == (2, 320 * 2**20)
    assert host_optimizer_shape(320 * 2**20, 64 * 2**30, ranks=8) == (2, 2**30 // 16)  # the memory's eighth
    assert host_optimizer_shape(None, 2**40, ranks=1) == (2, HOST_OPTIMIZER_BYTES // 16)
    assert host_optimizer_shape(2**20, 2**30, ranks=64) == (2, HOST_OPTIMIZER_BYTES // 16)


def test_the_groups_measured_in_a_node_are_the_powers_of_two_that_divide_it_and_the_node() -> None:
    assert {n: group_sizes(n) for n in (1, 2, 3, 4, 6, 8)} == {
        1: [], 2: [2], 3: [3], 4: [2, 4], 6: [2, 6], 8: [2, 4, 8]}
