"""Evaluating a checkpoint: the loss on a dataset (by position in the context) and the passkey test."""
