package main

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/identity/ca"
	"github.com/gozt/gozt/identity/certs"
	"github.com/gozt/gozt/internal/testutil"
	"github.com/prometheus/client_golang/prometheus"
)

// TestCertExpiryMetric: cert_expiry_timestamp_seconds has a series per identity with a
// certificate, its value the certificate's NotAfter.
func TestCertExpiryMetric(t *testing.T) {
	builtin, err := ca.NewBuiltin(filepath.Join(t.TempDir(), "ca"), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	m := certs.New(certs.Config{}, builtin)
	defer m.Close()
	reg := prometheus.NewRegistry()
	reg.MustRegister(certCollector{m}, newCSRFailures())
	if got, n := testutil.Gather(t, reg).Sum("cert_expiry_timestamp_seconds", nil); n != 0 {
		t.Fatalf("before any certificate: %d series (%v)", n, got)
	}
	id := identity.MustParse("spiffe://cluster.local/ns/default/sa/alice")
	iss, err := m.Certificate(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	got, n := testutil.Gather(t, reg).Sum("cert_expiry_timestamp_seconds", map[string]string{"identity": id.String()})
	if n != 1 || got != float64(iss.NotAfter.Unix()) {
		t.Fatalf("cert_expiry_timestamp_seconds{identity=%q} = %v (%d series); want %d", id, got, n, iss.NotAfter.Unix())
	}
}
