"""The SM clock, board power and temperature while each row of fusedce_linear_bench runs: does a
variant slow the whole call through the power limit? (Nsight Compute times kernels one at a time
on an idle chip, which hides the limit; docs/performance.md, "The board's power limit".)

    python3 dev/power_trace.py BUILD_DIR [fusedce_linear_bench arguments...]
    e.g. python3 dev/power_trace.py build --options --form window --iters 120 --shape 8192 896 151936

nvidia-smi samples every 20 ms beside the benchmark; each printed row (and each shape's "# floor
measured" line) is stamped as it arrives, and the samples of its interval, less the first fifth
(the previous row's tail and the warm-up runs), give its median clock and power. Use --iters large
enough that a row runs a second or more.
"""
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
import time


def samples(path):
    """(time, clock MHz, power W, temperature C) of every readable line of nvidia-smi's log."""
    out = []
    for line in open(path):
        p = [x.strip() for x in line.split(",")]
        try:
            t = datetime.datetime.strptime(p[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            out.append((t, float(p[1]), float(p[2]), float(p[3])))
        except (ValueError, IndexError):
            pass  # a sample nvidia-smi could not read
    return out


def stamped_lines(cmd):
    """The command's stdout and stderr lines, each with the time it arrived."""
    proc = subprocess.Popen(["stdbuf", "-oL", "-eL", *cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    lines = [(time.time(), line.rstrip("\n")) for line in proc.stdout]
    proc.wait()
    return lines


def main(argv):
    if not argv:
        sys.exit(__doc__)
    binary = os.path.join(argv[0], "bench", "fusedce_linear_bench")
    if not os.access(binary, os.X_OK):
        sys.exit(f"no {binary}: build the fusedce_linear_bench target in {argv[0]} first")
    subprocess.run(["nvidia-smi", "--query-gpu=name,clocks.max.sm,power.limit", "--format=csv,noheader"], check=True)
    with tempfile.NamedTemporaryFile("w", suffix=".csv") as log:
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu",
                                "--format=csv,noheader,nounits", "-lms", "20"], stdout=log)
        time.sleep(1)
        lines = stamped_lines([binary, *argv[1:]])
        smi.terminate()
        smi.wait()
        trace = samples(log.name)
    prev = None
    for t, text in lines:
        row = "|" in text and "---" not in text and "N x H" not in text
        if prev is not None and (row or "floor measured" in text):
            start = prev + 0.2 * (t - prev)
            s = [x for x in trace if start <= x[0] <= t]
            if s:
                clocks = sorted(x[1] for x in s)
                print(f"{text.strip()[:64]:64s} | {t - prev:5.2f} s | {len(s):3d} samples | clock "
                      f"{statistics.median(clocks):.0f} MHz (p10 {clocks[len(clocks) // 10]:.0f}) | power "
                      f"{statistics.median(x[2] for x in s):.0f} W | {max(x[3] for x in s):.0f} C")
        prev = t


if __name__ == "__main__":
    main(sys.argv[1:])
