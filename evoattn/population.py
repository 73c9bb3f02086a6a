"""Islands of elite programs: admission, parent selection, inspirations, ring migration.

Pure: no I/O, no clock, and every random choice is drawn from a `random.Random`
the caller passes in, so a run with the same seed makes the same choices and a
resumed run (snapshot + restore) continues exactly where it stopped.

Each island keeps the top `elites_per_island` correct programs, ranked by
fitness with ties broken by program id. The seed starts in every island (when
it is correct), as in FunSearch, so no island begins empty.
"""
from __future__ import annotations

import math
import random
from typing import Any

from .config import PopulationConfig
from .errors import RunDirError
from .types import Program

SNAPSHOT_VERSION = 1
TOURNAMENT_SIZE = 3                    # exploitation: best of 3 random elites


def _rank_key(p: Program) -> tuple[float, str]:
    return (-p.fitness, p.id)


def eligible(program: Program) -> bool:
    """Returns whether a program may become an elite: passed every check, finite fitness."""
    # verdict PASS means every integrity flag raised was resolved by re-verification;
    # any other verdict (incorrect, or an unresolved flag) keeps the program out.
    return program.correct and math.isfinite(program.fitness) and program.fitness >= 0.0


class Population:
    """The elites of every island; the search is the only caller that changes it."""

    def __init__(self, cfg: PopulationConfig, seed: Program) -> None:
        self.cfg = cfg
        self.seed = seed
        self._islands: list[list[Program]] = [[] for _ in range(cfg.islands)]
        # The run's best: the seed, then each challenger that beat it head to head (the
        # search's champion challenge), not merely the highest fitness read alone.
        self._champion: Program | None = seed if eligible(seed) else None
        if eligible(seed):
            for elites in self._islands:
                elites.append(seed)

    # ---- reading ---------------------------------------------------------
    def elites(self, island: int) -> list[Program]:
        """Returns an island's elites, best first."""
        return list(self._islands[island])

    def best(self) -> Program | None:
        """Returns the champion: the last program crowned (the seed at first); without one,
        the best elite anywhere, or None if no correct program exists."""
        if self._champion is not None:
            return self._champion
        return self.top()

    def top(self) -> Program | None:
        """Returns the elite of highest fitness anywhere (None if no correct program exists)."""
        tops = [e[0] for e in self._islands if e]
        return min(tops, key=_rank_key) if tops else None

    def crown(self, program: Program) -> None:
        """Makes a correct program the run's best (it won a head-to-head re-measurement)."""
        if eligible(program):
            self._champion = program

    def contains(self, program_id: str) -> bool:
        """Returns whether a program is an elite of some island."""
        return any(p.id == program_id for e in self._islands for p in e)

    def island_of_next(self, iteration: int) -> int:
        """Returns the island that iteration `iteration` works on (round-robin)."""
        return iteration % len(self._islands)

    # ---- changing --------------------------------------------------------
    def add(self, program: Program) -> bool:
        """Offers a program to its island; returns True if it became an elite there."""
        if not eligible(program) or self.contains(program.id):
            return False
        return self._insert(program.island % len(self._islands), program)

    def migrate(self) -> int:
        """Copies each island's best into the next island (a ring); returns how many entered."""
        if len(self._islands) < 2:
            return 0
        # Take every best before inserting any, so a program moves one step per migration.
        bests = [e[0] if e else None for e in self._islands]
        moved = 0
        for i, best in enumerate(bests):
            target = (i + 1) % len(self._islands)
            if best is not None and all(p.id != best.id for p in self._islands[target]):
                moved += self._insert(target, best)
        return moved

    def _insert(self, island: int, program: Program) -> bool:
        elites = self._islands[island]
        elites.append(program)
        elites.sort(key=_rank_key)
        del elites[self.cfg.elites_per_island:]
        return any(p is program for p in elites)

    # ---- choosing --------------------------------------------------------
    def select_parent(self, island: int, rng: random.Random) -> Program:
        """Returns a parent: a random elite with chance `exploration`, else a tournament winner."""
        elites = self._islands[island]
        if not elites:
            return self.best() or self.seed
        if rng.random() < self.cfg.exploration:
            return elites[rng.randrange(len(elites))]
        picks = rng.sample(range(len(elites)), min(TOURNAMENT_SIZE, len(elites)))
        return elites[min(picks)]       # elites are sorted: the lowest index is the fittest

    def inspirations(self, island: int, k: int, rng: random.Random,
                     exclude_id: str | None = None) -> list[Program]:
        """Returns up to k distinct elites: other islands' top programs first, then this island's."""
        taken = {exclude_id} if exclude_id else set()
        others: list[Program] = []
        for p in sorted((p for i, e in enumerate(self._islands) if i != island for p in e),
                        key=_rank_key):
            if p.id not in taken:
                taken.add(p.id)
                others.append(p)
        if len(others) > k:
            # Diversity: k of the top 2k other-island elites, kept in rank order.
            chosen = sorted(rng.sample(range(min(2 * k, len(others))), k))
            others = [others[i] for i in chosen]
        own = [p for p in self._islands[island] if p.id not in taken]
        return (others + own)[:k]

    # ---- resume ----------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Returns the population as JSON-ready ids: the seed and each island's elites in order."""
        return {"version": SNAPSHOT_VERSION, "seed": self.seed.id,
                "islands": [[p.id for p in e] for e in self._islands],
                "champion": self._champion.id if self._champion is not None else None}

    @classmethod
    def restore(cls, snapshot: dict[str, Any], programs_by_id: dict[str, Program],
                cfg: PopulationConfig) -> "Population":
        """Returns the population a snapshot describes, rebuilt from stored programs."""
        if snapshot.get("version") != SNAPSHOT_VERSION:
            raise RunDirError(f"population snapshot version {snapshot.get('version')!r} "
                              f"is not {SNAPSHOT_VERSION}")
        islands = snapshot["islands"]
        if len(islands) != cfg.islands:
            raise RunDirError(f"the stored population has {len(islands)} islands, "
                              f"the config asks for {cfg.islands}")

        def lookup(pid: str) -> Program:
            if pid not in programs_by_id:
                raise RunDirError(f"the stored population names program {pid}, "
                                  "which is not in the database")
            return programs_by_id[pid]

        pop = cls(cfg, lookup(snapshot["seed"]))
        # Elites are restored verbatim (not re-ranked), so resume is exact even if
        # elites_per_island was lowered: the cap applies from the next insertion.
        pop._islands = [[lookup(pid) for pid in ids] for ids in islands]
        if "champion" in snapshot:           # absent in runs from before the challenge
            champ = snapshot["champion"]
            pop._champion = lookup(champ) if champ else None
        else:
            pop._champion = pop.top()
        return pop
