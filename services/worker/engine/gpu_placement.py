"""Which GPU each DP rank of a worker runs on: the worker's GPUs (`--cuda-devices`, indices of
the devices visible to the process; all of them when unset), rank r on the (r mod n)-th. Every
process keeps every GPU visible (no CUDA_VISIBLE_DEVICES narrowing): CUDA IPC between workers
of one host, which NIXL's UCX uses to move KV from one GPU to another, needs the peer's device
visible in the importing process. No torch here: the count of visible devices is an argument."""

from __future__ import annotations

from shared.errors import InvalidArgument


def parse_gpu_list(text: str, name: str) -> tuple[int, ...]:
    """A list of GPU indices as a flag gives it ("2,3"; empty: ()). Raises InvalidArgument naming
    `name` for a list that is not integers, repeats one, or names a negative index."""
    if not text.strip():
        return ()
    try:
        gpus = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise InvalidArgument(
            f"{name} must be GPU indices separated by commas (e.g. '0,1'), got {text!r}"
        ) from None
    if len(set(gpus)) != len(gpus):
        raise InvalidArgument(f"{name} lists a GPU twice: {text!r}")
    negative = [g for g in gpus if g < 0]
    if negative:
        raise InvalidArgument(f"{name} {text!r} names GPU {negative[0]}: GPU indices are >= 0")
    return gpus


def worker_gpus(cuda_devices: str, visible: int) -> tuple[int, ...]:
    """The GPUs a worker's ranks use: `cuda_devices` ("2,3"; empty: all `visible` devices).
    Raises InvalidArgument naming the problem for a malformed list (parse_gpu_list) or an index
    that is not a visible device."""
    gpus = parse_gpu_list(cuda_devices, "cuda_devices")
    if not gpus:
        return tuple(range(visible))
    outside = [g for g in gpus if g >= visible]
    if outside:
        raise InvalidArgument(
            f"cuda_devices {cuda_devices!r} names GPU {outside[0]}, but this process sees {visible} "
            f"GPU(s) (indices 0 to {visible - 1}; CUDA_VISIBLE_DEVICES narrows them)"
        )
    return gpus


def rank_gpu(dp_rank: int, gpus: tuple[int, ...]) -> int:
    """The GPU of DP rank `dp_rank` among the worker's `gpus`."""
    return gpus[dp_rank % len(gpus)]


def ranks_on(gpu: int, dp_size: int, gpus: tuple[int, ...]) -> int:
    """How many of the worker's `dp_size` ranks run on `gpu` (they split its memory share)."""
    return sum(1 for r in range(dp_size) if rank_gpu(r, gpus) == gpu)
