"""A program whose workers make the hooked calls: two multiprocessing spawn children and one
`subprocess.run([sys.executable, ...])` child; the parent makes none. Usage: spawn_children.py HANDSHAKE_DIR."""

import multiprocessing
import subprocess
import sys

import handshake
import memtel_run_target


def child(directory: str, calls: int) -> None:
    for i in range(calls):
        memtel_run_target.logits(4, i + 1)
    handshake.report_and_wait(directory, calls)


if __name__ == "__main__":
    directory = sys.argv[1]
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=child, args=(directory, 3 + i)) for i in range(2)]
    for worker in workers:
        worker.start()
    script = f"import spawn_children; spawn_children.child({directory!r}, 2)"
    done = subprocess.run([sys.executable, "-c", script], check=False)
    for worker in workers:
        worker.join()
    codes = [done.returncode, *(w.exitcode for w in workers)]
    print("children exit codes", codes, flush=True)
    sys.exit(0 if codes == [0, 0, 0] else 1)
