// Command hbonecontrol serves Istio's own Go HBONE server (istio.io/istio/pkg/hbone: each
// CONNECT dials its target and copies both ways) over mutual TLS. It is the control the
// proxy's open-streams benchmark (BenchmarkVictimOpenStreams, HBONE_CONTROL) aims the same
// attack at: what the attack does to an honest client of a server that is not gozt.
//
// It reads its certificate chain and key, PEM, from HBONE_CONTROL_CERT (the shape
// internal/attack's CertPEM writes), listens on -addr, prints "ready" and serves until its
// standard input closes.
package main

import (
	"crypto/tls"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"os"

	"istio.io/istio/pkg/hbone"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:15008", "address to serve HBONE on")
	flag.Parse()
	pemBytes := []byte(os.Getenv("HBONE_CONTROL_CERT"))
	cert, err := tls.X509KeyPair(pemBytes, pemBytes)
	if err != nil {
		log.Fatalf("hbonecontrol: HBONE_CONTROL_CERT: %v", err)
	}
	srv := hbone.NewServer()
	srv.Protocols.SetHTTP2(true)
	srv.TLSConfig = &tls.Config{
		MinVersion:   tls.VersionTLS13,
		Certificates: []tls.Certificate{cert},
		// The benchmark measures serving, not authenticating: any client certificate is
		// taken (Istio's ztunnel-facing servers verify it against the mesh's roots).
		ClientAuth: tls.RequireAnyClientCert,
		NextProtos: []string{"h2"},
	}
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		log.Fatalf("hbonecontrol: %v", err)
	}
	go func() {
		io.Copy(io.Discard, os.Stdin)
		srv.Close()
	}()
	fmt.Println("ready")
	if err := srv.ServeTLS(ln, "", ""); err != nil && err.Error() != "http: Server closed" {
		log.Fatalf("hbonecontrol: %v", err)
	}
}
