package main

import (
	"bytes"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

func mustLogLevels(t testing.TB) *logLevels {
	t.Helper()
	l, err := newLogLevels("info", nil)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// POST /logging takes what istioctl ztunnel-config log sends (level=LEVEL,
// level=SCOPE:LEVEL,..., level=info&reset) and the Rust ztunnel's own SCOPE=LEVEL form, and
// answers as the Rust ztunnel does: the current levels, 400 for a bad one, 405 for GET.
func TestLoggingEndpoint(t *testing.T) {
	levels, err := newLogLevels("warn", map[string]string{"dns": "error"})
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	log := newLogger(&config{}, levels, &buf)
	access, dns := log.With("scope", "access"), log.With("scope", "dns")
	h := adminHandler(levels, func() map[string]any { return nil }, func() {})
	do := func(method, query string) (int, string) {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(method, "/logging"+query, nil))
		b, _ := io.ReadAll(rec.Result().Body)
		return rec.Code, strings.TrimSpace(string(b))
	}
	for _, tc := range []struct {
		method, query string
		code          int
		answer        string // the first line of the body
	}{
		{"GET", "", http.StatusMethodNotAllowed, "usage: POST /logging"},
		{"POST", "", 200, "current log level is dns=error,warn"},
		{"POST", "?level=debug", 200, "current log level is dns=error,debug"},
		{"POST", "?level=access:debug,info", 200, "current log level is access=debug,dns=error,info"},
		{"POST", "?level=dns=warn", 200, "current log level is access=debug,dns=warn,info"},
		{"POST", "?level=ztunnel::access=error", 200, "current log level is access=error,dns=warn,info"},
		{"POST", "?level=bogus", http.StatusBadRequest, `Invalid level provided: "bogus"`},
		{"POST", "?level=proxy:debug", http.StatusBadRequest, `Invalid level provided: gozt has no log scope "proxy"`},
		{"POST", "?level=access:loud", http.StatusBadRequest, `Invalid level provided: "access:loud"`},
		{"POST", "?level=info&reset", 200, "current log level is dns=error,info"},
		{"POST", "?reset", 200, "current log level is dns=error,warn"},
		{"POST", "?level=off", 200, "current log level is dns=error,off"},
		{"POST", "?level=trace", 200, "current log level is dns=error,debug"},
	} {
		code, body := do(tc.method, tc.query)
		first, _, _ := strings.Cut(body, "\n")
		if code != tc.code || !strings.HasPrefix(first, tc.answer) {
			t.Errorf("%s /logging%s = %d %q; want %d %q", tc.method, tc.query, code, first, tc.code, tc.answer)
		}
	}
	// The last state: default debug (trace), dns error, access following the default.
	buf.Reset()
	log.Debug("default")
	access.Debug("access")
	dns.Warn("dns hidden")
	dns.Error("dns")
	if got := buf.String(); !strings.Contains(got, "msg=default") || !strings.Contains(got, "msg=access") ||
		strings.Contains(got, "dns hidden") || !strings.Contains(got, "msg=dns") {
		t.Errorf("logged:\n%s", got)
	}
	if levels.scopes["access"].Level() != slog.LevelDebug {
		t.Errorf("access level %v; want debug, the default's", levels.scopes["access"].Level())
	}
}
