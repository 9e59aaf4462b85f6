"""Retrieval structures that drafters look continuations up in.

``suffix_tree`` serves the ``suffix`` drafter: suffix trees over this request
and previous outputs, with ``suffix_node`` (its nodes), ``suffix_match``
(incremental matching), ``suffix_draft`` (drafts and their scores) and
``suffix_tree_file`` (the on-disk cache).
``datastore`` serves the ``rest`` drafter: a memory-mapped suffix array over a
corpus, built offline by ``specstack datastore build``.  Both answer a
context with a ``lookup.Lookup`` (tokens, parents, path probabilities and
match statistics), which their drafter turns into the engine's ``Draft``.
"""
