"""A caller's side of an attested node: verify it before a prompt is sent, and talk to it only over the channel
that was verified (`client.verify`)."""
