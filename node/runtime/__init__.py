"""The daemon: start-up wiring, the status it reports, the vector-mode loop and shutdown."""
