package main

import (
	"errors"
	"math"
	"strconv"
	"time"
)

// The per-node budgets of the HBONE server (hbone.AdmissionConfig; hbone/admission.go says
// why each is what it is).
// Istio has no variables for them: the names are gozt's own. Each takes the
// hbone.AdmissionConfig convention: 0 is the default, a negative value turns the budget off.

// budgetHelp opens every budget variable's help.
const budgetHelp = "gozt only, Istio has no such variable. "

// budgetForm is the accepted forms of every budget variable.
const budgetForm = `a positive number, 0 or unset for the default, "off" or a negative number for no budget`

func budgetSettings() []setting {
	return []setting{
		budgetInt("HBONE_HANDSHAKE_WORKERS", "Inbound HBONE: TLS handshakes computing at once, below the Go threads so established connections keep a core (default GOMAXPROCS-1, at least 1)", func(c *config) *int { return &c.HandshakeWorkers }),
		budgetInt("HBONE_SOURCE_HANDSHAKES", "Inbound HBONE: handshakes in flight from one source IP; past it a new connection is refused before TLS, held unread until the handshake deadline and then reset, so that a client holding stalled handshakes does not dial again at once (default 256)", func(c *config) *int { return &c.SourceHandshakes }),
		budgetRate("HBONE_SOURCE_HANDSHAKE_RATE", "Inbound HBONE: new connections a second from one source IP, a burst of 8 s of it; handshakes that succeed are given back, so it binds sources whose handshakes fail or are calmed; past it one waits up to 1 s, then is refused (default 32)", func(c *config) *float64 { return &c.SourceHandshakeRate }),
		budgetRate("HBONE_SOURCE_FAILED_HANDSHAKE_RATE", "Inbound HBONE: failed handshakes a second of one source IP, a burst of 8 s of it; past it the source's connections are refused before TLS, held as with HBONE_SOURCE_HANDSHAKES (default 2)", func(c *config) *float64 { return &c.SourceFailedHandshakes }),
		budgetRate("HBONE_PEER_CONNECTION_RATE", "Inbound HBONE: new connections a second of one peer identity, a burst of 4 s of it; past it one waits up to 1 s, then is closed (default 32)", func(c *config) *float64 { return &c.PeerConnRate }),
		budgetInt("HBONE_PEER_STREAMS", "Inbound HBONE: open streams of one peer identity across its connections; past it a new one is refused (default 16384: a deployment's pods share one identity, so this is fan-in, not one client)", func(c *config) *int { return &c.PeerStreams }),
		budgetInt("HBONE_PEER_DIALS", "Inbound HBONE: streams of one peer identity waiting for their backend dial; past it a new one waits (default 256)", func(c *config) *int { return &c.PeerDials }),
		budgetRate("HBONE_STREAM_START_RATE", "Inbound HBONE: stream handlers started a second on one connection, a burst of ¼ s of it (at least 1), each given back once its stream carries a byte or ends; past it a new stream waits without a goroutine, so a peer that opens streams it never uses is set up no faster than this (default 64)", func(c *config) *float64 { return &c.StreamStarts }),
	}
}

// budgets are the settings of budgetSettings, as hbone.AdmissionConfig takes them.
type budgets struct {
	HandshakeWorkers, SourceHandshakes, PeerStreams, PeerDials int
	SourceHandshakeRate, SourceFailedHandshakes, PeerConnRate  float64
	StreamStarts                                               float64
}

func budgetInt(env, help string, f func(*config) *int) setting {
	return setting{env: env, goztOnly: true, form: budgetForm, help: budgetHelp + help, set: func(c *config, v string) error {
		n, err := parseBudget(v)
		if err == nil && n != math.Trunc(n) {
			err = errors.New("not a whole number")
		}
		if err == nil && math.Abs(n) > 1<<30 {
			err = errors.New("out of range")
		}
		*f(c) = int(n)
		return err
	}}
}

func budgetRate(env, help string, f func(*config) *float64) setting {
	return setting{env: env, goztOnly: true, form: budgetForm, help: budgetHelp + help, set: func(c *config, v string) error {
		n, err := parseBudget(v)
		if err == nil && n > 0 && n < 1/time.Hour.Seconds() {
			err = errors.New("too small a rate")
		}
		*f(c) = n
		return err
	}}
}

// parseBudget is 0 for "" (the default), -1 for off, else the number.
func parseBudget(v string) (float64, error) {
	switch v {
	case "":
		return 0, nil
	case "off":
		return -1, nil
	}
	n, err := strconv.ParseFloat(v, 64)
	if err != nil {
		return 0, errors.New("not a number")
	}
	if math.IsNaN(n) || math.IsInf(n, 0) {
		return 0, errors.New("not a finite number")
	}
	if n < 0 {
		return -1, nil
	}
	return n, nil
}
