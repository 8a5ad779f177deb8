"""The shared-memory ring of benchmarks/device/fp8_blockwise_gluon.py's warp-specialised kernel (gluon-ws), as a
protocol, run on the CPU in random interleavings: what the kernel's two consumer partitions and its TMA loads do to
the ring's mbarriers, step for step as _ws_consume and _ws_load_step write it, with the hardware's parity waits.

- ready[s] (count 1): a load's bytes landed; a consumer waits for phase parity (i // STAGES) & 1 before step i.
- empty[s] (count 2): both consumers' MMAs on stage s finished (each arrives once per step); warpgroup 0 waits for
  parity ((j // STAGES) & 1) ^ 1 before loading step j into stage j % STAGES (a fresh barrier's phase 1 counts as
  done), STAGES - 1 steps ahead of the step it consumes.
- mbarrier.wait(bar, p) returns once the phase of parity p has completed: with c phases completed, while
  c & 1 != p.

Checked over many interleavings and ring sizes: every run ends (no deadlock); a consumer reads only the step it
waited for (no load overwrote it, none still in flight); a load goes only into a stage whose previous step both
consumers finished. Mutations of the protocol (a load a step further ahead, an empty barrier counting one consumer,
the producer's parity without its flip) fail it, so the check can fail."""
import random

import pytest


def run(stages, steps, seed, lookahead=None, empty_count=2, flip=True):
    """One random interleaving: None if it ends cleanly, else what went wrong."""
    lookahead = stages - 1 if lookahead is None else lookahead
    rnd = random.Random(seed)
    ready_done = [0] * stages            # phases completed
    empty_done, empty_arrived = [0] * stages, [0] * stages
    content = [None] * stages            # the step whose bytes a stage holds (None: a load in flight)
    reading = [set() for _ in range(stages)]   # consumers whose MMAs still read a stage
    in_flight = []                       # loads issued, not landed: (stage, step)

    def passes(done, parity):
        return (done & 1) != parity

    def consumer(wg):
        """Yields between its steps; `True` when blocked (the scheduler retries)."""
        def load(j):
            s = j % stages
            parity = ((j // stages) & 1) ^ (1 if flip else 0)
            while not passes(empty_done[s], parity):
                yield True
            if reading[s]:
                raise AssertionError(f"step {j} loaded into stage {s} while {sorted(reading[s])} still read it")
            content[s] = None
            in_flight.append((s, j))
            yield False
        if wg == 0:
            for j in range(min(lookahead, steps)):
                yield from load(j)
        for i in range(steps):
            if wg == 0 and i + lookahead < steps:
                yield from load(i + lookahead)
            s = i % stages
            while not passes(ready_done[s], (i // stages) & 1):
                yield True
            if content[s] != i:
                raise AssertionError(f"consumer {wg} read stage {s} for step {i} holding {content[s]}")
            reading[s].add(wg)
            yield False                  # its MMAs run
            reading[s].discard(wg)
            empty_arrived[s] += 1
            if empty_arrived[s] == empty_count:
                empty_arrived[s] = 0
                empty_done[s] += 1
            yield False

    actors = {0: consumer(0), 1: consumer(1)}
    finished = set()
    blocked_rounds = 0
    while len(finished) < 2:
        choices = [a for a in actors if a not in finished] + (["tma"] if in_flight else [])
        who = rnd.choice(choices)
        if who == "tma":                 # a load lands
            s, j = in_flight.pop(rnd.randrange(len(in_flight)))
            content[s] = j
            ready_done[s] += 1
            blocked_rounds = 0
            continue
        try:
            blocked = next(actors[who])
        except StopIteration:
            finished.add(who)
            continue
        except AssertionError as error:
            return str(error)
        blocked_rounds = blocked_rounds + 1 if blocked else 0
        if blocked_rounds > 200 and not in_flight:
            return "deadlock"
    return None


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("steps", [1, 3, 7, 16])
def test_the_ring_protocol_ends_and_never_reads_or_overwrites_the_wrong_step(stages, steps):
    for seed in range(150):
        assert run(stages, steps, seed) is None, (stages, steps, seed)


@pytest.mark.parametrize("mutation", [dict(lookahead="stages"), dict(empty_count=1), dict(flip=False)])
def test_a_broken_protocol_fails_the_check(mutation):
    def broken(stages, seed):
        kwargs = dict(mutation)
        if kwargs.get("lookahead") == "stages":
            kwargs["lookahead"] = stages
        return run(stages, 12, seed, **kwargs)
    assert any(broken(stages, seed) for stages in (2, 3, 4) for seed in range(150))
