"""The provider node: HTTP API, auth, configuration, command line and the engine."""
