"""Build the DeepSpeed ops the test suite loads, before it runs: `make test` starts this beside the type check.

DeepSpeed compiles some ops with ninja the first time a process loads them, into torch's extensions cache
(~/.cache/torch_extensions): of those the toolkit loads, CPU Adam for optimizer offload (~40 s; its ZeRO runs skip
DeepSpeed's shared-memory collectives, see toolkit.strategies.zero.comm). Without this, the first test that needs
it pays its build. Here it is built the way DeepSpeed itself loads it (deepspeed.ops.adam), so the tests find it
built. Nothing to do where DeepSpeed is not installed or the op does not apply to the machine's accelerator; a
failed build is said in one line and left to the tests that need the op to report.
"""

from __future__ import annotations

import importlib.util
import sys
import time


def main() -> int:
    if importlib.util.find_spec("deepspeed") is None:
        print("deepspeed is not installed: no ops to build")
        return 0
    import deepspeed
    from deepspeed.ops.op_builder import CPUAdamBuilder

    from toolkit.process.leftovers import clear_deepspeed_leftovers

    clear_deepspeed_leftovers()  # a build lock a killed load left would make the build below wait forever
    builder = CPUAdamBuilder()
    if not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return 0  # not an op of this machine
    start = time.perf_counter()
    try:
        builder.load(verbose=False)
    except Exception as exc:  # noqa: BLE001 - the tests that load the op say what it is missing
        print(f"{builder.absolute_name()}: not built ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 0
    print(f"{builder.absolute_name()}: ready in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
