"""05_lines.py: two ranks, one output stream: lines written by print() can glue together, one write each cannot.

torchrun starts every worker as `python -u`. Unbuffered, print(line) writes the line, then its newline: two writes,
and another rank's line can land between them. sys.stdout.write(line + "\n") is one write (notebook 05, section 7).
  torchrun --standalone --nproc-per-node=2 scripts/05_lines.py > shared.out
"""
import argparse
import json
import os
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--lines", type=int, default=2000, help="how many lines each rank writes each way")
args = parser.parse_args()
rank = int(os.environ.get("RANK", "0"))
for i in range(args.lines):
    print(json.dumps({"rank": rank, "way": "print", "i": i}), flush=True)  # two writes under python -u
for i in range(args.lines):
    sys.stdout.write(json.dumps({"rank": rank, "way": "write", "i": i}) + "\n")  # one write
    sys.stdout.flush()
sys.stdout.write(json.dumps({"rank": rank, "way": "done", "unbuffered": sys.stdout.write_through}) + "\n")
