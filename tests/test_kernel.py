"""The launcher inside a real Jupyter kernel: rank lines arrive while the cell still runs."""

from __future__ import annotations

import textwrap

from jupyter_client.manager import start_new_kernel

# Each rank prints one line, then waits until the test has seen both first lines in the cell's output: the
# cell can only finish if the lines arrived while it ran. A rank never released gives up and says so.
SCRIPT = """
import os, sys, time
print(f"tick 0 from rank {os.environ['RANK']}", flush=True)
for _ in range(1200):
    if os.path.exists("release"):
        break
    time.sleep(0.1)
else:
    sys.exit("never released: the first lines did not reach the cell while it ran")
print(f"tick 1 from rank {os.environ['RANK']}", flush=True)
"""


def test_rank_lines_stream_into_a_running_cell(tmp_path):
    (tmp_path / "ticks.py").write_text(SCRIPT)
    km, kc = start_new_kernel(kernel_name="python3", cwd=str(tmp_path))
    try:
        code = textwrap.dedent("""
            from ddp_helpers import torchrun
            result = torchrun("ticks.py", nproc_per_node=2, timeout=300)
            print("DONE", sorted(result.exitcodes.items()))
        """)
        msg_id = kc.execute(code)
        text = ""  # every stream message of this cell, in order
        while True:
            msg = kc.get_iopub_msg(timeout=300)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "stream":
                text += msg["content"]["text"]
                if all(f"[rank {r}] tick 0 from rank {r}\n" in text for r in (0, 1)):
                    (tmp_path / "release").touch()  # both first lines came while the ranks still wait
            elif msg["msg_type"] == "error":
                raise AssertionError("\n".join(msg["content"]["traceback"]))
            elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
        assert (tmp_path / "release").exists(), text
        for rank in (0, 1):
            assert f"[rank {rank}] tick 1 from rank {rank}\n" in text, text
        assert text.index("[rank 0] tick 0") < text.index("[rank 0] tick 1"), text
        assert "DONE [(0, 0), (1, 0)]" in text, text
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
