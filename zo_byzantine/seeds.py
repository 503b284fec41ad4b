"""Seed domains: every seeded draw of a run, named in one place (SPEC 1.2).

Each draw is ``SeedSequence(key)`` with a domain constant in its key, so that two draws of different
purposes never share a stream. Directions are the exception: their key is the bare seed tuple
``(s, t, l, r)`` (``perturbation.direction_seed``), the one format every party must reproduce.

Key layouts (kept as they are: ledgers and runs made before this module replay bitwise):

    PARTITION      (s, PARTITION, draw)            the split of the training set over clients
    BYZANTINE_SET  (s, BYZANTINE_SET)              which clients are Byzantine (selection "random")
    SAMPLING       (s, SAMPLING, t)                the participants of round t
    DATA_ORDER     (s, DATA_ORDER, client, pass)   the order of a client's examples in one pass
    BUCKETING      (BUCKETING, s, t, uplink)       bucketing's shuffle (round key last)
    RANDOM_CHOICE  (RANDOM_CHOICE, s, t, uplink)   the random-choice attack's coins
    GAUSSIAN       (GAUSSIAN, s, t, uplink)        the Gaussian attack's noise
    FANG_TRIM      (FANG_TRIM, s, t, uplink)       the Fang trim attack's draws
    ROOT           (s, ROOT)                       the trusted clients' root data set (fltrust)
"""

from __future__ import annotations

import numpy as np
import torch

PARTITION = 0x9A47
BYZANTINE_SET = 0xB42
SAMPLING = 0xC11E
DATA_ORDER = 0xDA7A
BUCKETING = 0xB0C7
RANDOM_CHOICE = 0xC014
GAUSSIAN = 0x6A55
FANG_TRIM = 0xFA27
ROOT = 0x2007
SPREAD = 0x5B2E


def rng(*key: int) -> np.random.Generator:
    """A numpy generator seeded by ``SeedSequence(key)``."""
    return np.random.default_rng(np.random.SeedSequence([int(k) for k in key]))


def torch_generator(*key: int, device="cpu") -> torch.Generator:
    """A ``torch.Generator`` seeded by the first 64-bit word of ``SeedSequence(key)`` (63 bits kept)."""
    seed = np.random.SeedSequence([int(k) for k in key]).generate_state(1, np.uint64)[0]
    return torch.Generator(device=device).manual_seed(int(seed) >> 1)
