//go:build tools

// Package spire pins SPIRE's server and agent as tools of their own module, so SPIRE's
// server code (its cloud attestors, datastores and their SDKs) stays out of gozt's go.mod:
// gozt itself needs only SPIRE's API module (github.com/spiffe/spire-api-sdk). The SPIRE
// tests (cmd/ztunnel's TestSpire*) run them as a real server and agent. Build them with
// `make spire-tools` (into .tools/).
package spire

import (
	_ "github.com/spiffe/spire/cmd/spire-agent"
	_ "github.com/spiffe/spire/cmd/spire-server"
)
