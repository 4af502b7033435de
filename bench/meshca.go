package bench

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/gozt/gozt/identity/ca/catest"
)

// meshCA is the suite's one Istio-CA-protocol server (IstioCertificateService over TLS, an
// ECDSA P-256 root), shared by every node of every namespace path whatever its program, so
// that certificates' key type and chain are the same on every path and mixed pairs trust
// each other. It serves a listener inside each node's namespace on caAddr.
type meshCA struct {
	srv *catest.IstioServer
	ca  nodeCA
}

// meshCA returns the suite's CA, starting it the first time it is asked for; it stops when
// the suite ends.
func (s *suite) meshCA() (*meshCA, error) {
	if s.ca != nil {
		return s.ca, nil
	}
	root, err := catest.GenerateRoot("zbench mesh root")
	if err != nil {
		return nil, fmt.Errorf("bench: CA: %w", err)
	}
	// 127.0.0.1 for the nodes' dials; the name the Rust ztunnel and gozt accept by default.
	cert, err := root.NewServingCert("127.0.0.1", "istiod.istio-system.svc")
	if err != nil {
		return nil, fmt.Errorf("bench: CA: %w", err)
	}
	dir := filepath.Join(s.work, "mesh-ca")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("bench: %w", err)
	}
	c := &meshCA{ca: nodeCA{rootFile: filepath.Join(dir, "root-cert.pem"), tokenFile: filepath.Join(dir, "token")}}
	if err := os.WriteFile(c.ca.rootFile, root.PEM(), 0o644); err != nil {
		return nil, fmt.Errorf("bench: %w", err)
	}
	if err := os.WriteFile(c.ca.tokenFile, []byte("zbench"), 0o644); err != nil {
		return nil, fmt.Errorf("bench: %w", err)
	}
	c.srv = catest.NewIstio(root, &cert)
	s.onEnd(c.srv.Stop)
	s.ca = c
	return c, nil
}

// serveIn serves the CA on caAddr inside the namespace d dials from; the listener closes
// when the CA stops.
func (c *meshCA) serveIn(d *NetnsDialer) error {
	ln, err := d.Listen("tcp", caAddr)
	if err != nil {
		return fmt.Errorf("bench: CA listener: %w", err)
	}
	c.srv.Serve(ln)
	return nil
}
