package main

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
)

// logScopes are gozt's log scopes: the scope attribute of its loggers, the targets RUST_LOG
// and POST /logging can name.
var logScopes = []string{"access", "dns"}

// logLevels are the levels the logger follows, changed at run time by POST /logging: a
// default, and one per scope that follows the default until it is set. Reading a level is
// atomic (slog.LevelVar); mu serializes changes and their listing.
type logLevels struct {
	def    slog.LevelVar
	scopes map[string]*scopeLevel // every name in logScopes; the map is fixed at start

	mu      sync.Mutex
	initial []levelChange // the levels at start (LOG_LEVEL, RUST_LOG), which reset restores
}

// scopeLevel is one scope's level: its own once set, else a copy of the default's.
type scopeLevel struct {
	set bool // guarded by logLevels.mu
	lv  slog.LevelVar
}

func (s *scopeLevel) Level() slog.Level { return s.lv.Level() }

// levelChange sets the default level (scope "") or one scope's.
type levelChange struct {
	scope  string
	level  slog.Level
	target string // the target as written (ztunnel::access), for messages
}

// newLogLevels starts from the configuration's default level and levels per scope, in slog's
// names (LOG_LEVEL and RUST_LOG, already checked).
func newLogLevels(def string, scopes map[string]string) (*logLevels, error) {
	l := &logLevels{scopes: map[string]*scopeLevel{}}
	for _, s := range logScopes {
		l.scopes[s] = &scopeLevel{}
	}
	for _, c := range append([][2]string{{"", def}}, sortedPairs(scopes)...) {
		var level slog.Level
		if err := level.UnmarshalText([]byte(c[1])); err != nil {
			return nil, fmt.Errorf("log level %q: %w", c[1], err)
		}
		if c[0] != "" && l.scopes[c[0]] == nil {
			return nil, fmt.Errorf("no log scope %q", c[0])
		}
		l.initial = append(l.initial, levelChange{scope: c[0], level: level, target: c[0]})
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.setLocked(l.initial)
	return l, nil
}

func sortedPairs(m map[string]string) [][2]string {
	var out [][2]string
	for k, v := range m {
		out = append(out, [2]string{k, v})
	}
	slices.SortFunc(out, func(a, b [2]string) int { return strings.Compare(a[0], b[0]) })
	return out
}

// apply sets the levels directives names, after going back to the levels at start when reset
// is true. Nothing changes unless every directive is good.
func (l *logLevels) apply(directives string, reset bool) error {
	changes, err := parseDirectives(directives)
	if err != nil {
		return err
	}
	for _, c := range changes {
		if c.scope != "" && l.scopes[c.scope] == nil {
			return fmt.Errorf("gozt has no log scope %q; its scopes are %s", c.target, strings.Join(logScopes, ", "))
		}
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if reset {
		for _, s := range l.scopes {
			s.set = false
		}
		l.setLocked(l.initial)
	}
	l.setLocked(changes)
	return nil
}

// parseDirectives reads a directive list: a level (trace, debug, info, warn, error, off) sets
// the default; TARGET=LEVEL, or TARGET:LEVEL as istioctl ztunnel-config log writes it, sets one
// scope, named by the TARGET's last "::" segment (ztunnel::access is access).
func parseDirectives(directives string) ([]levelChange, error) {
	var changes []levelChange
	for _, d := range strings.Split(directives, ",") {
		d = strings.TrimSpace(d)
		if d == "" {
			continue
		}
		target, lv, hasTarget := strings.Cut(d, "=")
		if !hasTarget {
			target, lv, hasTarget = cutLast(d, ":")
		}
		if !hasTarget {
			target, lv = "", d
		}
		name, err := rustLevel(lv)
		if err != nil {
			return nil, fmt.Errorf("%q: %w; a level is trace, debug, info, warn, error or off", d, err)
		}
		var level slog.Level
		if err := level.UnmarshalText([]byte(name)); err != nil {
			return nil, err
		}
		scope := target
		if i := strings.LastIndex(target, "::"); i >= 0 {
			scope = target[i+2:]
		}
		if hasTarget && scope == "" {
			return nil, fmt.Errorf("%q: no target before the level", d)
		}
		changes = append(changes, levelChange{scope: scope, level: level, target: target})
	}
	return changes, nil
}

// setLocked applies changes, then copies the default into every scope without its own.
func (l *logLevels) setLocked(changes []levelChange) {
	for _, c := range changes {
		if c.scope == "" {
			l.def.Set(c.level)
			continue
		}
		s := l.scopes[c.scope]
		s.set = true
		s.lv.Set(c.level)
	}
	for _, s := range l.scopes {
		if !s.set {
			s.lv.Set(l.def.Level())
		}
	}
}

// String lists the levels as RUST_LOG directives, the scopes set on their own first, as the
// Rust ztunnel's /logging answers: "access=debug,info".
func (l *logLevels) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var parts []string
	for _, name := range logScopes {
		if s := l.scopes[name]; s.set {
			parts = append(parts, name+"="+levelName(s.lv.Level()))
		}
	}
	slices.Sort(parts)
	return strings.Join(append(parts, levelName(l.def.Level())), ",")
}

// levelName is a slog level in the Rust ztunnel's words.
func levelName(l slog.Level) string {
	switch {
	case l > slog.LevelError:
		return "off"
	case l >= slog.LevelError:
		return "error"
	case l >= slog.LevelWarn:
		return "warn"
	case l >= slog.LevelInfo:
		return "info"
	default:
		return "debug"
	}
}

// cutLast is strings.Cut at the last sep that is not part of a "::".
func cutLast(s, sep string) (before, after string, found bool) {
	for i := len(s) - 1; i >= 0; i-- {
		if s[i] == ':' && (i == 0 || s[i-1] != ':') && (i+1 == len(s) || s[i+1] != ':') {
			return s[:i], s[i+1:], true
		}
	}
	return s, "", false
}

// scopeHandler gives each logger the level of its scope attribute (access, dns), and the rest
// the default level.
type scopeHandler struct {
	slog.Handler
	levels *logLevels
	level  slog.Leveler // this logger's: the default or its scope's
}

func newScopeHandler(h slog.Handler, levels *logLevels) *scopeHandler {
	return &scopeHandler{Handler: h, levels: levels, level: &levels.def}
}

func (h *scopeHandler) Enabled(_ context.Context, l slog.Level) bool {
	return l >= h.level.Level()
}

func (h *scopeHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	next := &scopeHandler{Handler: h.Handler.WithAttrs(attrs), levels: h.levels, level: h.level}
	for _, a := range attrs {
		if s, ok := h.levels.scopes[a.Value.String()]; ok && a.Key == "scope" {
			next.level = s
		}
	}
	return next
}

func (h *scopeHandler) WithGroup(name string) slog.Handler {
	return &scopeHandler{Handler: h.Handler.WithGroup(name), levels: h.levels, level: h.level}
}
