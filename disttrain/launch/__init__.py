"""The job side: the command line, validation's caller, the run directory, and starting, supervising and
restarting the ranks (by fork server or new interpreter). Nothing outside this package imports it."""
