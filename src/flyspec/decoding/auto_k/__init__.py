"""The block size chosen every round (``-k auto``): the K, from 0 (the target alone) to the
largest allowed, that gives the most expected tokens per second.

A round that drafts K tokens costs ``C(K) = K * d + V(K + 1)``: ``d`` seconds per drafted token
and ``V(n)``, one target forward over n tokens. It commits ``E(K) = 1 + sum_{j=1..K}
prod_{i<=j} p_i(K)`` tokens on average, where ``p_i(K)`` is the chance that draft position
``i`` is kept once the ones before it were: kept exactly, or (FLy) loosely, which needs the
deferred window to fit in the block (``i + W <= K``; any K with deferral). The policy picks
``argmax E(K) / C(K)``, so where no block pays it decodes with the target alone.

``V`` starts from a measured table (two forwards per size over the first request's context,
the faster kept) and, like ``d`` and the per-position rates, follows what the rounds measure;
the estimates are shared by the requests of one decoder, each starting from what the ones
before it learnt. Rounds at K=0 teach nothing about acceptance, so after
:data:`~flyspec.decoding.auto_k.policy.PROBE_AFTER` of them in a row one round drafts again
at the best K above 0, where drafting could pay at a plausible acceptance; each probe that
leaves K=0 still best doubles the wait before the next.

Three parts: :mod:`~flyspec.decoding.auto_k.policy` (the choice: pure arithmetic, no model,
no file), :mod:`~flyspec.decoding.auto_k.measure` (the forwards it chooses from, timed by
flyspec's forward timer, and the draft model's catch-up) and
:mod:`~flyspec.decoding.auto_k.store` (the costs kept on disk between processes).
"""
