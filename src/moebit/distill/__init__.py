"""Mixture-of-Students: the student and its KD stage."""
