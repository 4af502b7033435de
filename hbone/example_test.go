package hbone_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"slices"

	"github.com/gozt/gozt/hbone"
	"github.com/gozt/gozt/hbone/internal/testcert"
	"github.com/gozt/gozt/identity"
)

// An HBONE server and a client of it over mutual TLS, each workload named by its SPIFFE ID.
// The client's Pool opens a CONNECT stream for 10.0.0.5:8080 (the destination behind the
// server); the server's Handler checks who is asking and echoes what it reads after a line
// of its own. The certificates come from a throwaway CA here; in a mesh, its CA issues them
// (in ztunnel, identity/ca and identity/certs).
func Example() {
	ca := testcert.NewCA()
	serverID := identity.MustParse("spiffe://cluster.local/ns/default/sa/server")
	clientID := identity.MustParse("spiffe://cluster.local/ns/default/sa/client")

	// The server: TLS with a client certificate required, then a Handler per stream.
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{
		Certificates: []tls.Certificate{ca.Issue(serverID.String())},
		ClientAuth:   tls.RequireAndVerifyClientCert,
		ClientCAs:    ca.Pool,
		MinVersion:   tls.VersionTLS13,
		NextProtos:   []string{"h2"},
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	srv := hbone.NewServer(hbone.ServerConfig{}, func(r *hbone.Request) {
		if r.Peer != clientID { // the SPIFFE ID of the client's verified certificate
			r.Reject(http.StatusUnauthorized)
			return
		}
		s, err := r.Accept(nil)
		if err != nil {
			return
		}
		defer s.Close()
		fmt.Fprintf(s, "%s to %s: ", r.Peer, r.Authority)
		io.Copy(s, s) // until the client's half-close
		s.CloseWrite()
	})
	ctx, stop := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ctx, ln) }()
	defer func() { stop(); <-served }()

	// The client: one Pool; a Key names who we are, whom we expect and where they listen.
	pool := hbone.NewPool(hbone.ClientConfig{}, spiffeClient(ca.Issue(clientID.String()), ca.Pool))
	defer pool.Close()
	key := hbone.NewKey(clientID, []identity.ID{serverID}, netip.MustParseAddrPort(ln.Addr().String()), netip.Addr{})
	s, err := pool.Dial(ctx, key, "10.0.0.5:8080", nil)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer s.Close()
	io.WriteString(s, "hello")
	s.CloseWrite() // END_STREAM: the server's io.Copy ends
	reply, err := io.ReadAll(s)
	fmt.Printf("%s %v\n", reply, err)
	// Output: spiffe://cluster.local/ns/default/sa/client to 10.0.0.5:8080: hello <nil>
}

// spiffeClient is a Pool's TLS: it presents cert, and accepts a server whose chain leads to
// roots and whose SPIFFE ID is one the Key expects. HBONE peers are named by SPIFFE ID, not
// by DNS name, so VerifyConnection replaces crypto/tls's name check.
func spiffeClient(cert tls.Certificate, roots *x509.CertPool) func(context.Context, hbone.Key) (*tls.Config, error) {
	return func(_ context.Context, k hbone.Key) (*tls.Config, error) {
		return &tls.Config{
			Certificates:       []tls.Certificate{cert},
			MinVersion:         tls.VersionTLS13,
			InsecureSkipVerify: true, // VerifyConnection checks the chain and the SPIFFE ID
			VerifyConnection: func(cs tls.ConnectionState) error {
				return verifyPeer(cs.PeerCertificates, roots, k.Expected())
			},
		}, nil
	}
}

// verifyPeer checks a server's chain against roots and its SPIFFE ID against want.
func verifyPeer(chain []*x509.Certificate, roots *x509.CertPool, want []identity.ID) error {
	if len(chain) == 0 {
		return errors.New("no server certificate")
	}
	inter := x509.NewCertPool()
	for _, c := range chain[1:] {
		inter.AddCert(c)
	}
	opts := x509.VerifyOptions{Roots: roots, Intermediates: inter, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	if _, err := chain[0].Verify(opts); err != nil {
		return err
	}
	id, err := identity.FromCert(chain[0])
	if err != nil {
		return err
	}
	if !slices.Contains(want, id) {
		return fmt.Errorf("server is %s, not one of %v", id, want)
	}
	return nil
}
