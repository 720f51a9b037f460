"""Discrete-event simulator of PEARL on a GPU cluster, driving the production controller."""
