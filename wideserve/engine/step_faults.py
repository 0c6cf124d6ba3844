"""What the engine core does when a step fails (docs/reliability.md, "A failed step").

A step is schedule -> execute (forward, sampling, drafts) -> update. An exception in
*execute* leaves the scheduler mid-step (in-flight flag set, num_computed_tokens advanced,
blocks allocated for tokens whose KV was never written). `Scheduler.fail_step` undoes that and
ends the step's requests with the error; everything else keeps being served. The engine then
re-checks the KV pool's invariants: if they no longer hold, or the error poisons the device
(a CUDA fault: every later kernel fails), or the failure is in the scheduler's own
bookkeeping, the state cannot be trusted and `EngineStateError` (engine/errors.py) says so;
the engine refuses further work and the engine process exits with that reason.
"""
from __future__ import annotations

# Substrings of errors after which a device context is unusable (PyTorch raises these as
# RuntimeError / torch.AcceleratorError, whose text names the fault).
_DEVICE_FATAL = ("CUDA error", "device-side assert", "illegal memory access",
                 "CUBLAS_STATUS", "cuDNN error", "NCCL error", "HIP error")


def poisons_device(error: BaseException) -> bool:
    """Whether `error` leaves the accelerator unusable (so no later step can succeed)."""
    if type(error).__name__ == "AcceleratorError":
        return True
    text = str(error)
    return any(marker in text for marker in _DEVICE_FATAL)


def step_error_message(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    detail = text[0][:500] if text else ""
    return f"engine step failed: {type(error).__name__}" + (f": {detail}" if detail else "")
