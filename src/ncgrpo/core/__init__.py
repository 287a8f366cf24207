"""The paper's math as pure tensor code: the noise (eq. 2-6), advantages (Prop. 2), image noise, the row plan.

Imports torch (and numpy/PIL for the image transform) only: no engine, no TRL, no transformers.
"""
