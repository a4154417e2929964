"""The SmolLM2 GRPO job's problems and its scoring, as ShardRL's lm_grpo draws and scores them, for
the Python side of the TRL comparison (trl_grpo.py trains on them, eval_heldout.py scores the held-out
ones). Written from ShardRL's C++ (algos::make_arithmetic_problems, algos::parse_last_integer,
lm_grpo's Problems), not imported from it: it is the reference the comparison checks ShardRL against.
"""
import re

PROMPTS_PER_STEP = 4  # data.train_batch_size
NUM_GENERATIONS = 8  # actor_rollout_ref.rollout.n
MICRO_BATCH = 8  # actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu


class MT19937_64:
    """std::mt19937_64, so that the problems are ShardRL's (algos::make_arithmetic_problems)."""

    N, M = 312, 156
    MASK = (1 << 64) - 1

    def __init__(self, seed):
        self.mt = [seed & self.MASK]
        for i in range(1, self.N):
            prev = self.mt[-1]
            self.mt.append((6364136223846793005 * (prev ^ (prev >> 62)) + i) & self.MASK)
        self.index = self.N

    def __call__(self):
        if self.index >= self.N:
            upper, lower = 0xFFFFFFFF80000000, 0x7FFFFFFF
            for i in range(self.N):
                x = (self.mt[i] & upper) | (self.mt[(i + 1) % self.N] & lower)
                xa = x >> 1
                if x & 1:
                    xa ^= 0xB5026F5AA96619E9
                self.mt[i] = self.mt[(i + self.M) % self.N] ^ xa
            self.index = 0
        y = self.mt[self.index]
        self.index += 1
        y ^= (y >> 29) & 0x5555555555555555
        y ^= (y << 17) & 0x71D67FFFEDA60000
        y ^= (y << 37) & 0xFFF7EEE000000000
        y ^= y >> 43
        return y & self.MASK


# The C++ standard fixes the 10000th output of a default-seeded (5489) mt19937_64.
_check = MT19937_64(5489)
for _ in range(9999):
    _check()
assert _check() == 9981545732273789042, "MT19937_64 is not std::mt19937_64"


def make_problems(count, seed, digits=2):
    """(a, b, a + b) as make_arithmetic_problems draws them with operators "+"."""
    gen = MT19937_64(seed)
    limit = 10**digits
    out = []
    for _ in range(count):
        a, b = gen() % limit, gen() % limit
        gen()  # the operator's draw, from the one-operator string "+"
        out.append((a, b, a + b))
    return out


def held_out_problems(val_size, seed):
    """lm_grpo's Problems: data.val_size held-out problems, drawn from their own stream."""
    return make_problems(val_size, seed * 31337 + 17)


def question(a, b):
    """The user turn each problem is asked in (lm_grpo's arithmetic prompt)."""
    return f"What is {a} + {b}?"


def training_problems(step, seed, val_size, count=PROMPTS_PER_STEP):
    """lm_grpo's Problems::training(count, step): fresh draws that avoid the held-out ones."""
    held_out = {(a, b) for a, b, _ in held_out_problems(val_size, seed)}
    out = []
    for round_ in range(100):
        for a, b, s in make_problems(count, seed * 1000003 + step + round_ * 7919):
            if (a, b) not in held_out and len(out) < count:
                out.append((a, b, s))
        if len(out) == count:
            return out
    raise ValueError("the held-out problems leave too few to train on")


_LAST_INTEGER = re.compile(r"(?<![0-9])(-?)([0-9]+)(?=[^0-9]*$)")


def last_integer(text):
    """algos::parse_last_integer: the last run of digits, negative when a '-' precedes it that
    does not follow a digit ("3-4" is 4, "= -4" is -4)."""
    m = _LAST_INTEGER.search(text)
    if not m:
        return None
    start = m.start(2)
    negative = bool(m.group(1)) and (start < 2 or text[start - 2] not in "0123456789")
    return -int(m.group(2)) if negative else int(m.group(2))
