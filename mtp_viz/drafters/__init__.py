"""Trained drafters for a frozen target: a small draft model and sequential MTP heads.

Both share the target's input embedding and read its LM head through a frequency-ranked reduced
vocabulary (`vocab.ReducedHead`), so what ships is only what was trained.
"""
