"""Publishing a tuned config to production: targets, canary, transaction, history."""
