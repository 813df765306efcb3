"""The command line: the parser and dispatch (main), and each subcommand that is not the daemon itself."""
