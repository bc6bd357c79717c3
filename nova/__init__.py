"""Nova: a just-in-time compiler for whole deep-learning training steps.

    step = nova.compile(model, optimizer, precision="fp32")
    loss = step(x, y)   # forward, backward and optimizer update in one call
"""

from nova.errors import AutodiffError, BatchError, CaptureError, NovaError, UnsupportedError

__all__ = ["compile", "CompiledStep", "DataParallel", "verify", "VerifyReport", "NovaError", "UnsupportedError", "AutodiffError", "CaptureError", "BatchError"]
__version__ = "0.1.0"


def __getattr__(name):
    # the compiler (xDSL, torch.export) loads on first use, so `import nova` stays light
    if name in ("compile", "CompiledStep"):
        from nova import api

        return getattr(api, name)
    if name == "DataParallel":  # data_parallel=nova.DataParallel("zero1", bucket_bytes=...)
        from nova.runtime.distributed import DataParallel

        return DataParallel
    if name in ("verify", "VerifyReport"):
        from nova import verification

        return getattr(verification, name)
    raise AttributeError(f"module 'nova' has no attribute {name!r}")
