"""The router: sends each caller's requests to a provider node that meets their requirements, preferring warm state."""
