"""The launcher inside a real Jupyter kernel: rank lines arrive while the cell still runs."""

from __future__ import annotations

import textwrap
import time

from jupyter_client.manager import start_new_kernel

SCRIPT = """
import os, time
for i in range(3):
    print(f"tick {i} from rank {os.environ['RANK']}", flush=True)
    time.sleep(1.5)
"""


def test_rank_lines_stream_into_a_running_cell(tmp_path):
    (tmp_path / "ticks.py").write_text(SCRIPT)
    km, kc = start_new_kernel(kernel_name="python3", cwd=str(tmp_path))
    try:
        code = textwrap.dedent("""
            from ddp_helpers import torchrun
            result = torchrun("ticks.py", nproc_per_node=2, timeout=120)
            print("DONE", sorted(result.exitcodes.items()))
        """)
        msg_id = kc.execute(code)
        arrivals = []  # (seconds since execute, text) for every stream message of this cell
        start = time.monotonic()
        while True:
            msg = kc.get_iopub_msg(timeout=120)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "stream":
                arrivals.append((time.monotonic() - start, msg["content"]["text"]))
            elif msg["msg_type"] == "error":
                raise AssertionError("\n".join(msg["content"]["traceback"]))
            elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
        text = "".join(t for _, t in arrivals)
        for rank in (0, 1):
            for i in range(3):
                assert f"[rank {rank}] tick {i} from rank {rank}\n" in text
        assert "DONE [(0, 0), (1, 0)]" in text
        first_tick = min(t for t, s in arrivals if "tick 0" in s)
        done = min(t for t, s in arrivals if "DONE" in s)
        # Live, not at the end: tick 0 arrives while the ranks still sleep through two more ticks.
        assert done - first_tick >= 2.0, arrivals
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
