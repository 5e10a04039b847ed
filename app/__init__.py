"""The application: the `lowbit` command line and what it drives (run(), resume, ranks, fit, the audit)."""
