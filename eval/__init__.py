"""specdistill evaluation side: the speculative decoder, acceptance metrics, speed model, reports and plots."""
