"""A discrete-event model of the CPU schedule on the shared-document workload: 8 streams, each
request one prompt step (its first token) and 49 decode steps, its successor arriving `h` ms
after the step that gave its last token. Step costs from bench/probe_step_parts.py on the
2-core AMD EPYC (a 12-token question 36 ms; a decode step 6 + 4.3 ms a row). Prints, for each
rule, the median time from a later request's arrival to its first token, the wall time and the
inter-token p50/p99. The present rule ("first tokens before the decodes"): a step gives one
prompt its first token, and the decodes held by it run in the next step.

    python schedule_model.py"""
import random
import statistics


def simulate(requests=480, streams=8, prompt_ms=36.0, fixed_ms=6.0, row_ms=4.3, h=12.0,
             tokens=50, seed=0, prompt_steps_in_a_row=1, part_before_prompt=None):
    """`part_before_prompt`: with a prompt waiting right after a prompt step, decode only that
    share of the rows (those that waited longest) before it."""
    rng = random.Random(seed)
    t, sent, done, held = 0.0, streams, 0, 0
    pending = [(0.0, i) for i in range(streams)]
    arrival = {i: 0.0 for i in range(streams)}
    first, left, last, gaps, future = {}, {}, {}, [], []

    def decode(rows):
        nonlocal t, done, sent
        t += fixed_ms + row_ms * len(rows)
        for i in rows:
            left[i] -= 1
            gaps.append(t - last[i])
            last[i] = t
            if left[i] == 0:
                del left[i]
                done += 1
                if sent < requests:
                    a = t + h + rng.uniform(-3.0, 3.0)
                    arrival[sent] = a
                    future.append((a, sent))
                    sent += 1

    while done < requests:
        future.sort()
        while future and future[0][0] <= t:
            pending.append(future.pop(0))
        if pending and (held < prompt_steps_in_a_row or not left):
            _, i = pending.pop(0)
            t += prompt_ms
            held += 1
            first[i], left[i], last[i] = t, tokens - 1, t
        elif left:
            rows = list(left)
            if part_before_prompt and pending and held and len(rows) > 1:
                rows.sort(key=lambda i: last[i])
                rows = rows[:max(1, int(len(rows) * part_before_prompt))]
            decode(rows)
            held = 0
        else:
            t = min(a for a, _ in future)
    later = [first[i] - arrival[i] for i in first if i >= streams]
    gaps.sort()
    return statistics.median(later), t / 1000, statistics.median(gaps), gaps[int(0.99 * len(gaps))]


def main():
    rules = {"present rule": {}, "two prompt steps in a row": {"prompt_steps_in_a_row": 2}}
    for share in (0.25, 0.5, 0.75):
        rules[f"decode {share:.0%} of the rows before a waiting prompt"] = {"part_before_prompt": share}
    for name, kwargs in rules.items():
        runs = [simulate(seed=s, **kwargs) for s in range(8)]
        ttft, wall, itl50, itl99 = (statistics.mean(r[k] for r in runs) for k in range(4))
        print(f"{name:48s} TTFT p50 {ttft:6.1f} ms  wall {wall:6.1f} s  ITL p50 {itl50:5.1f} p99 {itl99:6.1f} ms")


if __name__ == "__main__":
    main()
