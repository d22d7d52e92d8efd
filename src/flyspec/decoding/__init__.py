"""The algorithm: verification rules as pure tensor functions (``verify``), the decoding loop
(``loop``) and the request it carries from round to round (``request``), the drafters
(``drafters``: the draft model, prompt lookup, MLA, and a prediction of the answer backed by
one of them), ``-k auto``'s block size (``auto_k``) and the statistics every round records
(``stats``)."""
