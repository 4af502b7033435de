package main

import (
	"strings"
	"testing"

	"github.com/gozt/gozt/hbone"
)

// Each HBONE budget variable: unset or 0 is hbone's default, "off" or a negative value
// turns the budget off, a number sets it, and a bad value stops the start naming the
// variable.
func TestBudgetSettings(t *testing.T) {
	for _, tc := range []struct {
		env, val string
		get      func(hbone.AdmissionConfig) float64
		want     float64 // what hbone.AdmissionConfig gets
		bad      string  // the error's words, for a bad value
	}{
		{env: "HBONE_SOURCE_HANDSHAKES", val: "", get: srcHands, want: 0},
		{env: "HBONE_SOURCE_HANDSHAKES", val: "0", get: srcHands, want: 0},
		{env: "HBONE_SOURCE_HANDSHAKES", val: "500", get: srcHands, want: 500},
		{env: "HBONE_SOURCE_HANDSHAKES", val: "off", get: srcHands, want: -1},
		{env: "HBONE_SOURCE_HANDSHAKES", val: "-3", get: srcHands, want: -1},
		{env: "HBONE_SOURCE_HANDSHAKES", val: "2.5", bad: "not a whole number"},
		{env: "HBONE_SOURCE_HANDSHAKES", val: "lots", bad: "not a number"},
		{env: "HBONE_SOURCE_HANDSHAKES", val: "1e12", bad: "out of range"},
		{env: "HBONE_SOURCE_HANDSHAKE_RATE", val: "12.5", get: func(c hbone.AdmissionConfig) float64 { return c.SourceHandshakeRate }, want: 12.5},
		{env: "HBONE_SOURCE_HANDSHAKE_RATE", val: "off", get: func(c hbone.AdmissionConfig) float64 { return c.SourceHandshakeRate }, want: -1},
		{env: "HBONE_SOURCE_HANDSHAKE_RATE", val: "NaN", bad: "not a finite number"},
		{env: "HBONE_SOURCE_HANDSHAKE_RATE", val: "0.0000001", bad: "too small a rate"},
		{env: "HBONE_SOURCE_FAILED_HANDSHAKE_RATE", val: "5", get: func(c hbone.AdmissionConfig) float64 { return c.SourceFailedHandshakes }, want: 5},
		{env: "HBONE_PEER_CONNECTION_RATE", val: "100", get: func(c hbone.AdmissionConfig) float64 { return c.PeerConnRate }, want: 100},
		{env: "HBONE_PEER_STREAMS", val: "4000", get: func(c hbone.AdmissionConfig) float64 { return float64(c.PeerStreams) }, want: 4000},
		{env: "HBONE_PEER_DIALS", val: "-1", get: func(c hbone.AdmissionConfig) float64 { return float64(c.PeerDials) }, want: -1},
		{env: "HBONE_STREAM_START_RATE", val: "off", get: func(c hbone.AdmissionConfig) float64 { return c.StreamStarts }, want: -1},
		{env: "HBONE_HANDSHAKE_WORKERS", val: "3", get: func(c hbone.AdmissionConfig) float64 { return float64(c.HandshakeWorkers) }, want: 3},
	} {
		t.Run(tc.env+"="+tc.val, func(t *testing.T) {
			c, err := loadConfig(env(map[string]string{tc.env: tc.val}), nil, nil)
			if tc.bad != "" {
				if err == nil || !strings.Contains(err.Error(), tc.env) || !strings.Contains(err.Error(), tc.bad) {
					t.Fatalf("loadConfig = %v; want an error naming %s and saying %q", err, tc.env, tc.bad)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := tc.get(nodeProxyConfig(c).HBONEServer.Admission); got != tc.want {
				t.Errorf("hbone.AdmissionConfig gets %v; want %v", got, tc.want)
			}
		})
	}
}

func srcHands(c hbone.AdmissionConfig) float64 { return float64(c.SourceHandshakes) }
