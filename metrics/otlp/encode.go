package otlp

import (
	"context"
	"encoding"
	"fmt"
	"log/slog"
	"math"
	"time"

	"google.golang.org/protobuf/encoding/protowire"
)

// Field numbers of opentelemetry/proto's logs, common and resource messages (v1).
const (
	reqResourceLogs = 1 // ExportLogsServiceRequest.resource_logs

	rlResource  = 1 // ResourceLogs.resource
	rlScopeLogs = 2 // ResourceLogs.scope_logs

	resAttributes = 1 // Resource.attributes

	slScope      = 1 // ScopeLogs.scope
	slLogRecords = 2 // ScopeLogs.log_records

	scopeName = 1 // InstrumentationScope.name

	lrTime         = 1  // LogRecord.time_unix_nano (fixed64)
	lrSeverity     = 2  // LogRecord.severity_number
	lrSeverityText = 3  // LogRecord.severity_text
	lrBody         = 5  // LogRecord.body
	lrAttributes   = 6  // LogRecord.attributes
	lrObservedTime = 11 // LogRecord.observed_time_unix_nano (fixed64)

	kvKey   = 1 // KeyValue.key
	kvValue = 2 // KeyValue.value

	avString = 1 // AnyValue.string_value
	avBool   = 2 // AnyValue.bool_value
	avInt    = 3 // AnyValue.int_value
	avDouble = 4 // AnyValue.double_value (fixed64)
	avKVList = 6 // AnyValue.kvlist_value: KeyValueList{values = 1}
	avBytes  = 7 // AnyValue.bytes_value
)

// encodeResource is ResourceLogs' resource field: attrs as the Resource's attributes.
func encodeResource(attrs []KeyValue) []byte {
	var res []byte
	for _, kv := range attrs {
		res = appendKV(res, resAttributes, kv.Key, slog.StringValue(kv.Value))
	}
	b := protowire.AppendTag(nil, rlResource, protowire.BytesType)
	return protowire.AppendBytes(b, res)
}

// encodeRequest is an ExportLogsServiceRequest of one ResourceLogs (resource, from
// encodeResource) with one ScopeLogs named scope holding records (each an encoded
// LogRecord).
func encodeRequest(resource []byte, scope string, records [][]byte) []byte {
	sc := protowire.AppendTag(nil, scopeName, protowire.BytesType)
	sc = protowire.AppendString(sc, scope)
	sl := protowire.AppendTag(nil, slScope, protowire.BytesType)
	sl = protowire.AppendBytes(sl, sc)
	for _, r := range records {
		sl = protowire.AppendTag(sl, slLogRecords, protowire.BytesType)
		sl = protowire.AppendBytes(sl, r)
	}
	rl := append([]byte(nil), resource...)
	rl = protowire.AppendTag(rl, rlScopeLogs, protowire.BytesType)
	rl = protowire.AppendBytes(rl, sl)
	req := protowire.AppendTag(make([]byte, 0, len(rl)+8), reqResourceLogs, protowire.BytesType)
	return protowire.AppendBytes(req, rl)
}

// encodeRecord is r as a LogRecord, mapped as the OpenTelemetry slog bridge (otelslog) maps
// it: the message is the body, the level the severity (slog's levels sit 9 below OTLP's
// severity numbers: INFO 9, WARN 13, ERROR 17) and its name the severity text, attrs (the
// handler's, already encoded) and then the record's own as attributes.
func encodeRecord(r slog.Record, attrs []byte, group string) []byte {
	b := make([]byte, 0, 512)
	if !r.Time.IsZero() {
		b = protowire.AppendTag(b, lrTime, protowire.Fixed64Type)
		b = protowire.AppendFixed64(b, uint64(r.Time.UnixNano()))
	}
	b = protowire.AppendTag(b, lrObservedTime, protowire.Fixed64Type)
	b = protowire.AppendFixed64(b, uint64(time.Now().UnixNano()))
	b = protowire.AppendTag(b, lrSeverity, protowire.VarintType)
	b = protowire.AppendVarint(b, uint64(int64(r.Level)+9))
	b = protowire.AppendTag(b, lrSeverityText, protowire.BytesType)
	b = protowire.AppendString(b, r.Level.String())
	b = protowire.AppendTag(b, lrBody, protowire.BytesType)
	b = protowire.AppendBytes(b, appendValue(nil, slog.StringValue(r.Message)))
	b = append(b, attrs...)
	r.Attrs(func(a slog.Attr) bool {
		b = appendAttr(b, lrAttributes, group, a)
		return true
	})
	return b
}

// appendAttr appends a as a KeyValue field num, its key prefixed by group ("g." for the
// handler's WithGroup("g")); an empty attribute is left out, as slog's handlers do.
func appendAttr(b []byte, num protowire.Number, group string, a slog.Attr) []byte {
	a.Value = a.Value.Resolve()
	if a.Equal(slog.Attr{}) || a.Value.Kind() == slog.KindGroup && len(a.Value.Group()) == 0 {
		return b
	}
	if a.Key == "" && a.Value.Kind() == slog.KindGroup { // inlined, as slog's handlers do
		for _, ga := range a.Value.Group() {
			b = appendAttr(b, num, group, ga)
		}
		return b
	}
	return appendKV(b, num, group+a.Key, a.Value)
}

// appendKV appends one KeyValue field num.
func appendKV(b []byte, num protowire.Number, key string, v slog.Value) []byte {
	kv := protowire.AppendTag(nil, kvKey, protowire.BytesType)
	kv = protowire.AppendString(kv, key)
	kv = protowire.AppendTag(kv, kvValue, protowire.BytesType)
	kv = protowire.AppendBytes(kv, appendValue(nil, v))
	b = protowire.AppendTag(b, num, protowire.BytesType)
	return protowire.AppendBytes(b, kv)
}

// appendValue appends v as an AnyValue's fields, converted as otelslog converts it:
// durations and times as integer nanoseconds, unsigned integers past int64 as doubles,
// groups as key-value lists, errors and other values as their text.
func appendValue(b []byte, v slog.Value) []byte {
	switch v.Kind() {
	case slog.KindString:
		b = protowire.AppendTag(b, avString, protowire.BytesType)
		return protowire.AppendString(b, v.String())
	case slog.KindBool:
		b = protowire.AppendTag(b, avBool, protowire.VarintType)
		return protowire.AppendVarint(b, protowire.EncodeBool(v.Bool()))
	case slog.KindInt64:
		return appendInt(b, v.Int64())
	case slog.KindUint64:
		if u := v.Uint64(); u <= math.MaxInt64 {
			return appendInt(b, int64(u))
		}
		return appendDouble(b, float64(v.Uint64()))
	case slog.KindFloat64:
		return appendDouble(b, v.Float64())
	case slog.KindDuration:
		return appendInt(b, v.Duration().Nanoseconds())
	case slog.KindTime:
		return appendInt(b, v.Time().UnixNano())
	case slog.KindGroup:
		var list []byte
		for _, a := range v.Group() {
			list = appendAttr(list, 1, "", a) // KeyValueList.values
		}
		b = protowire.AppendTag(b, avKVList, protowire.BytesType)
		return protowire.AppendBytes(b, list)
	case slog.KindLogValuer:
		return appendValue(b, v.Resolve())
	}
	switch x := v.Any().(type) {
	case []byte:
		b = protowire.AppendTag(b, avBytes, protowire.BytesType)
		return protowire.AppendBytes(b, x)
	case error:
		return appendValue(b, slog.StringValue(x.Error()))
	case fmt.Stringer:
		return appendValue(b, slog.StringValue(x.String()))
	case encoding.TextMarshaler:
		if t, err := x.MarshalText(); err == nil {
			return appendValue(b, slog.StringValue(string(t)))
		}
	}
	return appendValue(b, slog.StringValue(fmt.Sprint(v.Any())))
}

func appendInt(b []byte, i int64) []byte {
	b = protowire.AppendTag(b, avInt, protowire.VarintType)
	return protowire.AppendVarint(b, uint64(i))
}

func appendDouble(b []byte, f float64) []byte {
	b = protowire.AppendTag(b, avDouble, protowire.Fixed64Type)
	return protowire.AppendFixed64(b, math.Float64bits(f))
}

// handler is the Exporter's slog.Handler: records at INFO and above, encoded at once and
// queued. WithGroup prefixes the keys that follow ("g.key") rather than nesting them.
type handler struct {
	exp   *Exporter
	attrs []byte // encoded LogRecord.attributes fields from WithAttrs
	group string // "" or the groups joined by dots, with a trailing dot
}

func (h *handler) Enabled(_ context.Context, l slog.Level) bool { return l >= slog.LevelInfo }

func (h *handler) Handle(_ context.Context, r slog.Record) error {
	if r.Level < slog.LevelInfo {
		return nil
	}
	h.exp.enqueue(encodeRecord(r, h.attrs, h.group))
	return nil
}

func (h *handler) WithAttrs(as []slog.Attr) slog.Handler {
	h2 := *h
	h2.attrs = append([]byte(nil), h.attrs...)
	for _, a := range as {
		h2.attrs = appendAttr(h2.attrs, lrAttributes, h.group, a)
	}
	return &h2
}

func (h *handler) WithGroup(name string) slog.Handler {
	if name == "" {
		return h
	}
	h2 := *h
	h2.group = h.group + name + "."
	return &h2
}
