"""Rollout correction's tensor side: token lags and masks (torch, no verl)."""
