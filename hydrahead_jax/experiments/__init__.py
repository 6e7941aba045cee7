"""Experiments that measure the conversion: equal-budget comparisons of variants (``compare``) and the student's
distance from its teacher at initialisation (``init_study``)."""
