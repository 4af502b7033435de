package main

import (
	"github.com/gozt/gozt/identity/certs"
	"github.com/prometheus/client_golang/prometheus"
)

// Certificate metrics (gozt's; the Rust ztunnel has none): users asked for them after
// expired tokens made CSRs fail while ztunnel stayed Ready, its certificates lapsing
// unseen. Istio's agent exports the time left as cert_expiry_seconds; a timestamp, as
// the crl_* gauges, needs no scrape to stay right and alerts as
// `cert_expiry_timestamp_seconds - time() < 3600`.

// certCollector exports each identity's certificate expiry.
type certCollector struct{ m *certs.Manager }

var certExpiry = prometheus.NewDesc("cert_expiry_timestamp_seconds",
	"When the certificate each workload identity uses expires (gozt)", []string{"identity"}, nil)

func (c certCollector) Describe(ch chan<- *prometheus.Desc) { ch <- certExpiry }

func (c certCollector) Collect(ch chan<- prometheus.Metric) {
	for _, e := range c.m.Expiries() {
		ch <- prometheus.MustNewConstMetric(certExpiry, prometheus.GaugeValue, float64(e.NotAfter.Unix()), e.Identity)
	}
}

// newCSRFailures counts failed CSRs by reason (identity/certs' CSRFail* words).
func newCSRFailures() *prometheus.CounterVec {
	return prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "cert_csr_failures_total",
		Help: "Failed certificate signing requests to the CA, by reason: unauthenticated, permission_denied, unavailable, timeout, invalid_response, other (gozt)",
	}, []string{"reason"})
}
