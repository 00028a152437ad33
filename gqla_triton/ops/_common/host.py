"""Host-side integer helpers for launchers. Plain Python: ``triton.cdiv`` / ``triton.next_power_of_2`` are
constexpr functions whose calls cost about a microsecond each, which adds up on the small-launch paths."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 0 else 0
