package xds

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/gozt/gozt/metrics"
	"github.com/gozt/gozt/xds/xdspb"
)

// The metrics package registers the xDS families with the rest of Istio's; the client must
// share them rather than fail on the one registry a node has.
func TestClientMetricsShareRegistry(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := metrics.New(reg, "test")
	cm, err := newClientMetrics(reg)
	if err != nil {
		t.Fatalf("newClientMetrics on a registry the metrics package filled: %v", err)
	}
	cm.messages.WithLabelValues(xdspb.AddressType).Inc()
	if got := testutil.ToFloat64(m.XDSMessages.WithLabelValues(xdspb.AddressType)); got != 1 {
		t.Fatalf("istio_xds_message_total seen through metrics = %v; want 1", got)
	}
}
