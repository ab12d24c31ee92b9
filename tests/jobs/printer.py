"""Prints numbered lines ("line 0", "line 1", …) at a given rate, then exits 0.
Used to check that the stream loses and repeats nothing."""

import sys
import time

count = int(sys.argv[1])
rate = float(sys.argv[2]) if len(sys.argv) > 2 else 1000.0
stream = sys.stdout
batch = max(1, int(rate / 50))  # write in ~20 ms batches
t0 = time.monotonic()
i = 0
while i < count:
    n = min(batch, count - i)
    stream.write("".join(f"line {j}\n" for j in range(i, i + n)))
    stream.flush()
    i += n
    ahead = i / rate - (time.monotonic() - t0)
    if ahead > 0:
        time.sleep(ahead)
