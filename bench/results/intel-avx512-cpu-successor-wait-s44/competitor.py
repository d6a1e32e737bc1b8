"""Burns CPU in short bursts: BURST_US of work every PERIOD_US (a stand-in for an event loop and a client)."""
import sys, time
burst, period = int(sys.argv[1]) / 1e6, int(sys.argv[2]) / 1e6
end = time.monotonic() + float(sys.argv[3])
busy = 0.0
while time.monotonic() < end:
    t = time.monotonic()
    while time.monotonic() - t < burst:
        pass
    busy += time.monotonic() - t
    time.sleep(max(0.0, period - (time.monotonic() - t)))
print(f"competitor busy {busy:.2f} s", file=sys.stderr)
