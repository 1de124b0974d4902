"""Which devices this machine has, and a device argument checked against them: the one check that the model, a
checkpoint's device_map, the lab's settings and an activation cache's moves all make, so that a device this machine
lacks ("cuda" without a GPU, "mps", "xpu", ...) is refused with its name and the devices there are."""

from __future__ import annotations

import torch

Device = torch.device | str | int


def available_devices() -> list[str]:
    """The devices a tensor can be put on here: the CPU, meta (shapes without values) and each accelerator."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    count = torch.accelerator.device_count() if accelerator is not None else 0
    if accelerator is not None and accelerator.type == "cuda" and not torch.cuda.is_available():
        count = 0  # CUDA switched off (CUDA_VISIBLE_DEVICES="", or a test that says so)
    return ["cpu", "meta", *(f"{accelerator.type}:{i}" for i in range(count))]


def available_device(value: Device | None, where: str = "device") -> torch.device:
    """``value`` (a device name such as ``"cpu"``, ``"cuda:1"`` or ``"meta"``, a GPU index, a ``torch.device``; None
    for the CPU) as a torch.device this machine has; anything else raises ValueError naming ``where`` (the argument),
    the value and the devices available here."""
    available = available_devices()
    device = None
    if value is None:
        device = torch.device("cpu")
    elif isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        device = torch.device(accelerator.type if accelerator is not None else "cuda", value)
    elif isinstance(value, str | torch.device):
        try:
            device = torch.device(value)
        except (RuntimeError, TypeError, ValueError):
            raise ValueError(f"{where}={value!r} is not available on this machine (available here: "
                             f"{', '.join(available)}): torch knows no such device; {where} must be a torch.device "
                             f"or a device name such as 'cpu', 'cuda', 'cuda:1' or 'meta'") from None
    if device is None:
        raise ValueError(f"{where} must be a torch.device or a device name such as 'cpu', 'cuda', 'cuda:1' or 'meta' "
                         f"(or a GPU index); got {value!r} (available here: {', '.join(available)})")
    named = f"{device.type}:{device.index or 0}"
    if device.type not in ("cpu", "meta") and named not in available:
        given = repr(value) if isinstance(value, int | torch.device) else repr(str(device))
        raise ValueError(f"{where}={given} is not available on this machine (available here: "
                         f"{', '.join(available)})")
    return device
