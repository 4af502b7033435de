package certs_test

import (
	"context"
	"crypto/tls"
	"log"
	"time"

	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/identity/ca"
	"github.com/gozt/gozt/identity/certs"
)

// How cmd/ztunnel wires the pieces: a CA client from the environment, one manager, and the
// two TLS builders handed to the HBONE client pool and the 15008 listener.
func Example() {
	ctx := context.Background()
	client, err := ca.New(ctx, ca.Config{Provider: "builtin", Dir: "/var/lib/gozt/cacerts", SecretTTL: 24 * time.Hour})
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()
	m := certs.New(certs.Config{}, client)
	defer m.Close()

	src := identity.MustParse("spiffe://cluster.local/ns/default/sa/sleep")
	dst := identity.MustParse("spiffe://cluster.local/ns/default/sa/httpbin")
	m.Prefetch(src) // the workload appeared on this node

	// Outbound: dial <pod IP>:15008 with this config (no ServerName).
	clientTLS, err := m.ClientConfig(ctx, src, []identity.ID{dst})
	if err != nil {
		log.Fatal(err)
	}
	_ = clientTLS

	// Inbound: the proxy maps the connection's destination to the local workload's identity.
	serverTLS := m.ServerConfig(func(hello *tls.ClientHelloInfo) (identity.ID, error) {
		return dst, nil
	})
	_ = serverTLS
	// After the handshake: peer, err := certs.PeerIdentity(conn.ConnectionState())
}
