"""Retrieval structures that drafters look continuations up in.

``suffix_tree`` (with ``suffix_tree_file`` for its on-disk cache) serves the
``suffix`` drafter: suffix trees over this request and previous outputs.
``datastore`` serves the ``rest`` drafter: a memory-mapped suffix array over a
corpus, built offline by ``specstack datastore build``.
"""
