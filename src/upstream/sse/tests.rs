//! The event-stream parser by the rules, whatever the chunking, and the reader's bounds.

use super::*;
use proptest::prelude::*;

const BIG: u64 = 1 << 30;

/// Events of `chunks` fed one after the other to one parser.
fn parse_chunks(chunks: &[&[u8]], cap: u64) -> Result<Vec<Event>, SseError> {
    let mut p = Parser::new(cap);
    let mut out = Vec::new();
    for c in chunks {
        let mut rest = *c;
        loop {
            let (used, ev) = p.feed(rest)?;
            assert!(p.held() as u64 <= cap);
            rest = &rest[used..];
            out.extend(ev);
            if rest.is_empty() {
                break;
            }
        }
    }
    Ok(out)
}

fn data(body: &[u8]) -> Vec<String> {
    data_events(body, BIG).unwrap()
}

fn ev(data: &str, event: &str, id: &str) -> Event {
    Event {
        data: data.into(),
        event: event.into(),
        id: id.into(),
    }
}

/// The spec's first example: events split by blank lines, two `data` lines joined by LF.
#[test]
fn spec_example_messages() {
    let body = b"data: This is the first message.\n\ndata: This is the second message, it\ndata: has two lines.\n\ndata: This is the third message.\n\n";
    assert_eq!(
        data(body),
        [
            "This is the first message.",
            "This is the second message, it\nhas two lines.",
            "This is the third message."
        ]
    );
}

/// The spec's example with `event` types: each event carries its own, reset after it.
#[test]
fn spec_example_event_types() {
    let body =
        b"event: add\ndata: 73857293\n\nevent: remove\ndata: 2153\n\nevent: add\ndata: 113411\n\n";
    assert_eq!(
        events(body, BIG).unwrap(),
        [
            ev("73857293", "add", ""),
            ev("2153", "remove", ""),
            ev("113411", "add", "")
        ]
    );
}

/// The spec's example of `data` with no colon: an empty value; the unfinished last
/// event is discarded.
#[test]
fn spec_example_data_without_colon() {
    assert_eq!(data(b"data\n\ndata\ndata\n\ndata:"), ["", "\n"]);
}

/// The spec's example: one space after the colon is dropped, no space is fine.
#[test]
fn spec_example_one_space_dropped() {
    assert_eq!(data(b"data:test\n\ndata: test\n\n"), ["test", "test"]);
    assert_eq!(data(b"data:  two\n\n"), [" two"]);
    assert_eq!(data(b"data: a:b\n\n"), ["a:b"]);
}

/// Streams of the web-platform tests' `format-*` cases for EventSource, with the data
/// the browsers must deliver: field names matched exactly (NUL, case, a leading space
/// or `-`/`_` make another field), values kept byte for byte past the one space.
#[test]
fn web_platform_format_cases() {
    let body = b"data:\0\ndata:  2\rData:1\ndata\0:2\ndata:1\r\0data:4\nda-ta:3\rdata_5\ndata:3\rdata:\r\n data:32\ndata:4\n\n";
    assert_eq!(data(body), ["\0\n 2\n1\n3\n\n4"]);
    assert_eq!(
        data(b"data:test\r\ndata\ndata:test\r\n\r"),
        ["test\n\ntest"]
    );
    assert_eq!(
        data(b"data:\ttest\rdata: \ndata:test\n\n"),
        ["\ttest\n\ntest"]
    );
    assert_eq!(data(b"data:\0\n\n"), ["\0"]);
    assert_eq!(
        events(b"event: \ndata:data\n\n", BIG).unwrap(),
        [ev("data", "", "")]
    );
    assert_eq!(
        events(b"id:1\0\ndata:x\n\n", BIG).unwrap(),
        [ev("x", "", "")]
    );
    assert_eq!(
        data(b"retry:1000\ndata:test1\n\nid:test\ndata:test2"),
        ["test1"]
    );
}

/// A leading BOM is skipped; a second one, or one later in the stream, is not a BOM
/// but part of a field name (so that line is ignored).
#[test]
fn bom_is_skipped_once_at_the_start_only() {
    assert_eq!(data(b"\xEF\xBB\xBFdata: a\n\n"), ["a"]);
    assert!(data(b"\xEF\xBB\xBF\xEF\xBB\xBFdata: a\n\n").is_empty());
    assert_eq!(
        data(b"data: a\n\n\xEF\xBB\xBFdata: b\n\ndata: c\n\n"),
        ["a", "c"]
    );
    // Split anywhere inside the BOM.
    let chunks: [&[u8]; 4] = [b"\xEF", b"\xBB", b"\xBFdata:", b" a\n\n"];
    assert_eq!(parse_chunks(&chunks, BIG).unwrap()[0].data, "a");
    // A start that only looks like a BOM for a byte is kept as line content.
    assert!(data(b"\xEFdata: a\n\n").is_empty());
    assert_eq!(data(b"\xEF\ndata: a\n\n"), ["a"]);
}

/// LF, CRLF and a bare CR each end a line, mixed freely.
#[test]
fn every_line_end_ends_a_line() {
    for body in [
        &b"data: a\ndata: b\n\ndata: c\n\n"[..],
        b"data: a\r\ndata: b\r\n\r\ndata: c\r\n\r\n",
        b"data: a\rdata: b\r\rdata: c\r\r",
        b"data: a\rdata: b\r\n\ndata: c\n\r",
    ] {
        assert_eq!(data(body), ["a\nb", "c"], "{body:?}");
    }
}

/// A CR ending a chunk ends its line at once, and an LF opening the next chunk is the
/// rest of that CRLF, not a blank line (which would split the event).
#[test]
fn a_crlf_split_across_chunks_is_one_line_end() {
    let chunks: [&[u8]; 3] = [b"data: a\r", b"\ndata: b\r", b"\n\r\n"];
    assert_eq!(parse_chunks(&chunks, BIG).unwrap(), [ev("a\nb", "", "")]);
    // A blank line ended by a CR dispatches without waiting for the next byte.
    let mut p = Parser::new(BIG);
    assert_eq!(p.feed(b"data: x\r").unwrap(), (8, None));
    assert_eq!(p.feed(b"\r").unwrap(), (1, Some(ev("x", "", ""))));
    // Then an LF is the second half of that CRLF: no further blank line.
    assert_eq!(p.feed(b"\ndata: y\n\n").unwrap().1, Some(ev("y", "", "")));
}

/// Comments are ignored, whether alone, between `data` lines or empty.
#[test]
fn comments_are_ignored() {
    assert!(data(b": keep-alive\n\n:\n\n").is_empty());
    assert_eq!(data(b"data: a\n: note\ndata: b\n\n"), ["a\nb"]);
}

/// `id` persists across events, is ignored when it holds a NUL, and an `id` with no
/// value resets it; `retry` is kept only when all digits; unknown fields and field
/// names in another case are ignored.
#[test]
fn id_retry_and_unknown_fields() {
    let body = b"id: 7\ndata: a\n\ndata: b\n\nid: x\0y\ndata: c\n\nid\ndata: d\n\n";
    let got = events(body, BIG).unwrap();
    let ids: Vec<&str> = got.iter().map(|e| e.id.as_str()).collect();
    assert_eq!(ids, ["7", "7", "7", ""]);
    let mut p = Parser::new(BIG);
    p.feed(b"retry: 1500\n").unwrap();
    assert_eq!(p.retry(), Some(1500));
    p.feed(b"retry: 15x\nretry:\n").unwrap();
    assert_eq!(p.retry(), Some(1500));
    assert_eq!(data(b"foo: bar\nData: x\nDATA: y\ndata: z\n\n"), ["z"]);
}

/// An event with no `data` is not dispatched, and its type does not leak into the next.
#[test]
fn an_event_without_data_is_not_dispatched() {
    assert_eq!(
        events(b"event: ping\n\ndata: x\n\n", BIG).unwrap(),
        [ev("x", "", "")]
    );
    assert!(data(b"id: 1\n\n\n\n").is_empty());
}

/// The stream's end discards an event no blank line finished, with or without its
/// last line end.
#[test]
fn an_unterminated_last_event_is_discarded() {
    assert_eq!(data(b"data: a\n\ndata: b\n"), ["a"]);
    assert_eq!(data(b"data: a\n\ndata: b"), ["a"]);
    assert_eq!(data(b"data: a\n\ndata: b\r"), ["a"]);
}

/// A line that never ends, and an event whose lines never stop, are refused at the
/// cap, holding no more than it.
#[test]
fn endless_lines_and_events_are_refused_at_the_cap() {
    let mut p = Parser::new(1000);
    let piece = [b'x'; 100];
    let mut refused = false;
    for _ in 0..20 {
        match p.feed(&piece) {
            Ok(_) => assert!(p.held() <= 1000),
            Err(e) => {
                assert_eq!(e, SseError::TooLarge(1000));
                refused = true;
                break;
            }
        }
    }
    assert!(refused);
    let lines = b"data: 0123456789\n".repeat(100);
    assert_eq!(events(&lines, 1000), Err(SseError::TooLarge(1000)));
    // A line exactly at the cap is fine (the cap counts whole lines, field included).
    assert_eq!(data_events(b"data: abc\n\n", 9).unwrap(), ["abc"]);
    assert_eq!(data_events(b"data: abc\n\n", 8), Err(SseError::TooLarge(8)));
    // So is an event exactly at it: held are the data so far and the line being read.
    assert_eq!(data_events(b"data: a\ndata: b\n\n", 9).unwrap(), ["a\nb"]);
    assert_eq!(
        data_events(b"data: a\ndata: b\n\n", 8),
        Err(SseError::TooLarge(8))
    );
}

/// Event data that is not UTF-8 is refused, not decoded with replacement characters.
#[test]
fn data_not_utf8_is_refused() {
    assert_eq!(events(b"data: \xFF\n\n", BIG), Err(SseError::NotUtf8));
    // Field names and comments are not data.
    assert_eq!(data(b": \xFF\nid: \xFF\ndata: ok\n\n"), ["ok"]);
}

/// Serves one request on a loopback listener: reads it whole, then answers 200 with
/// `body` as an event stream in HTTP chunks of the sizes `sizes` cycles through
/// (each becomes a separate piece for the reader, so the splits are the ones chosen).
async fn serve_chunked(body: Vec<u8>, sizes: &'static [usize]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let (mut sock, _) = listener.accept().await.unwrap();
        let mut req = Vec::new();
        let mut buf = [0u8; 4096];
        let body_start = loop {
            let n = sock.read(&mut buf).await.unwrap();
            assert!(n > 0, "request cut");
            req.extend_from_slice(&buf[..n]);
            if let Some(i) = req.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
        };
        let head = String::from_utf8_lossy(&req[..body_start]).to_ascii_lowercase();
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .map_or(0, |v| v.trim().parse().unwrap());
        while req.len() < body_start + len {
            let n = sock.read(&mut buf).await.unwrap();
            assert!(n > 0, "request body cut");
            req.extend_from_slice(&buf[..n]);
        }
        sock.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
                .await
                .unwrap();
        let mut rest = &body[..];
        for &size in sizes.iter().cycle() {
            if rest.is_empty() {
                break;
            }
            let (piece, more) = rest.split_at(size.min(rest.len()));
            let mut chunk = format!("{:x}\r\n", piece.len()).into_bytes();
            chunk.extend_from_slice(piece);
            chunk.extend_from_slice(b"\r\n");
            sock.write_all(&chunk).await.unwrap();
            sock.flush().await.unwrap();
            rest = more;
        }
        sock.write_all(b"0\r\n\r\n").await.unwrap();
        let _ = sock.shutdown().await;
    });
    url
}

/// `events` as an event stream opening with a BOM (right before the first `data:`),
/// the events' line ends cycling through `ends`, a comment after each.
fn bom_stream(events: &[String], ends: &[&str]) -> Vec<u8> {
    let mut body = BOM.to_vec();
    for (k, e) in events.iter().enumerate() {
        let end = ends[k % ends.len()];
        body.extend_from_slice(format!("data: {e}{end}{end}: keep-alive{end}").as_bytes());
    }
    body
}

/// Posts to `url` and reads the answer through the workers' streaming path.
async fn stream_through(url: &str, sglang: bool) -> (super::super::Generation, u32) {
    crate::upstream::tls::install_provider();
    let resp = reqwest::Client::builder()
        .no_proxy()
        .build()
        .unwrap()
        .post(url)
        .json(&serde_json::json!({"stream": true}))
        .send()
        .await
        .unwrap();
    let mut r = Reader::new(resp, 1 << 20, Instant::now(), url.to_string());
    let tokens = std::sync::atomic::AtomicU32::new(0);
    let sink = |n: u32| {
        tokens.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    };
    let g = if sglang {
        super::super::sglang::read_stream(&mut r, &sink).await
    } else {
        super::super::openai::read_stream(&mut r, false, &sink).await
    };
    (g.unwrap(), tokens.into_inner())
}

/// Through reqwest and the OpenAI protocol's stream reader (deltas): a BOM-prefixed
/// stream, with LF line ends and then with CR, CRLF and LF mixed, split inside the BOM
/// and between CR and LF, keeps every token of text (a first event dropped for its
/// BOM, or CR-ended lines run together, would lose some).
#[tokio::test]
async fn a_bom_and_cr_line_ends_keep_every_token_openai() {
    let n = 12;
    let mut evs: Vec<String> = (1..=n)
        .map(|k| {
            let fin = if k == n { "\"length\"" } else { "null" };
            format!(r#"{{"choices":[{{"index":0,"text":" w{k}","finish_reason":{fin}}}]}}"#)
        })
        .collect();
    evs.push("[DONE]".into());
    for ends in [&["\n"][..], &["\r", "\r\n", "\n"]] {
        let url = serve_chunked(bom_stream(&evs, ends), &[1, 2, 3, 5, 8, 13]).await;
        let (g, tokens) = stream_through(&format!("{url}/v1/completions"), false).await;
        let want: String = (1..=n).map(|k| format!(" w{k}")).collect();
        assert_eq!(g.text, want, "{ends:?}");
        assert_eq!((g.finish_reason.as_str(), tokens), ("length", n));
    }
}

/// Through reqwest and the chat reader, in small HTTP chunks: reasoning deltas in both
/// spellings and two tool calls interleaved by index come out whole, the text is the
/// content only, and the sink counted every generated event (reasoning and calls too).
#[tokio::test]
async fn reasoning_and_tool_calls_survive_any_chunking_chat() {
    let d = |delta: serde_json::Value, fin: Option<&str>| {
        serde_json::json!({"choices": [{"index": 0, "delta": delta, "finish_reason": fin}]})
            .to_string()
    };
    let call = |i: u32, extra: serde_json::Value| {
        let mut c = serde_json::json!({"index": i});
        for (k, v) in extra.as_object().into_iter().flatten() {
            c[k] = v.clone();
        }
        d(serde_json::json!({"tool_calls": [c]}), None)
    };
    let evs = vec![
        d(
            serde_json::json!({"role": "assistant", "content": ""}),
            None,
        ),
        d(serde_json::json!({"reasoning_content": "I should"}), None),
        d(serde_json::json!({"reasoning": " call both"}), None),
        call(
            0,
            serde_json::json!({"id": "a", "type": "function", "function": {"name": "f", "arguments": "{\"x\":"}}),
        ),
        call(
            1,
            serde_json::json!({"id": "b", "type": "function", "function": {"name": "g", "arguments": "{"}}),
        ),
        call(0, serde_json::json!({"function": {"arguments": "1}"}})),
        call(1, serde_json::json!({"function": {"arguments": "}"}})),
        d(serde_json::json!({"content": "done"}), Some("tool_calls")),
        "[DONE]".to_string(),
    ];
    let url = serve_chunked(bom_stream(&evs, &["\n", "\r\n"]), &[3, 1, 7, 2]).await;
    let (g, tokens) = stream_through_chat(&format!("{url}/v1/chat/completions")).await;
    assert_eq!(g.text, "done");
    assert_eq!(g.reasoning.as_deref(), Some("I should call both"));
    assert_eq!(
        g.tool_calls,
        Some(serde_json::json!([
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{\"x\":1}"}},
            {"id": "b", "type": "function", "function": {"name": "g", "arguments": "{}"}},
        ]))
    );
    assert_eq!(
        (g.finish_reason.as_str(), tokens, g.chunks),
        ("tool_calls", 7, 7)
    );
}

/// Posts to `url` and reads the answer through the chat streaming path.
async fn stream_through_chat(url: &str) -> (super::super::Generation, u32) {
    crate::upstream::tls::install_provider();
    let resp = reqwest::Client::builder()
        .no_proxy()
        .build()
        .unwrap()
        .post(url)
        .json(&serde_json::json!({"stream": true}))
        .send()
        .await
        .unwrap();
    let mut r = Reader::new(resp, 1 << 20, Instant::now(), url.to_string());
    let tokens = std::sync::atomic::AtomicU32::new(0);
    let sink = |n: u32| {
        tokens.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    };
    let g = super::super::openai::read_stream(&mut r, true, &sink).await;
    (g.unwrap(), tokens.into_inner())
}

/// The same through SGLang's `/generate` reader, with cumulative events (every event
/// repeats the output so far): the last event's text and ids are all kept.
#[tokio::test]
async fn a_bom_and_cr_line_ends_keep_every_token_sglang() {
    let n = 10u32;
    let mut evs: Vec<String> = (1..=n)
            .map(|k| {
                let text: String = (1..=k).map(|i| format!(" w{i}")).collect();
                let ids: Vec<u32> = (1..=k).collect();
                let fin = if k == n {
                    serde_json::json!({"type": "length", "length": k})
                } else {
                    serde_json::Value::Null
                };
                serde_json::json!({"text": text, "output_ids": ids,
                    "meta_info": {"prompt_tokens": 1, "completion_tokens": k, "finish_reason": fin}})
                .to_string()
            })
            .collect();
    evs.push("[DONE]".into());
    let url = serve_chunked(bom_stream(&evs, &["\r", "\r\n", "\n"]), &[2, 1, 7, 3]).await;
    let (g, tokens) = stream_through(&format!("{url}/generate"), true).await;
    let want: String = (1..=n).map(|k| format!(" w{k}")).collect();
    assert_eq!(g.text, want);
    assert_eq!(g.token_ids, Some((1..=n).collect()));
    assert_eq!((g.finish_reason.as_str(), tokens), ("length", n));
}

/// An event the body does not finish is not dispatched: a stream whose `[DONE]` has no
/// blank line after it ends without `[DONE]`, which the protocol reports as cut.
#[tokio::test]
async fn an_unfinished_done_is_a_cut_stream() {
    let body = b"data: {\"choices\":[{\"index\":0,\"text\":\"a\",\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n".to_vec();
    let url = serve_chunked(body, &[7]).await;
    crate::upstream::tls::install_provider();
    let resp = reqwest::Client::new()
        .post(format!("{url}/v1/completions"))
        .send()
        .await
        .unwrap();
    let mut r = Reader::new(resp, 1 << 20, Instant::now(), url);
    let err = super::super::openai::read_stream(&mut r, false, &|_| {})
        .await
        .unwrap_err();
    assert!(matches!(err, UpstreamError::StreamCut(_)), "{err:?}");
}

/// A line that never ends, streamed, is refused at the cap rather than held.
#[tokio::test]
async fn an_endless_line_is_refused_at_the_cap_through_the_reader() {
    let mut body = b"data: {\"choices\":[{\"text\":\"".to_vec();
    body.extend(std::iter::repeat_n(b'x', 64 << 10));
    let url = serve_chunked(body, &[4096]).await;
    crate::upstream::tls::install_provider();
    let resp = reqwest::Client::new().post(&url).send().await.unwrap();
    let mut r = Reader::new(resp, 8 << 10, Instant::now(), url);
    let err = r.next_event().await.unwrap_err();
    assert!(matches!(err, UpstreamError::TooLarge(8192)), "{err:?}");
    assert!(r.parser.held() <= 8 << 10);
}

/// A straightforward reading of the rules over a whole stream, to check the
/// incremental parser against.
fn oracle(body: &[u8]) -> Vec<Event> {
    let body = body.strip_prefix(&BOM[..]).unwrap_or(body);
    let mut lines: Vec<&[u8]> = Vec::new();
    let (mut start, mut i) = (0, 0);
    while i < body.len() {
        if body[i] == b'\r' || body[i] == b'\n' {
            lines.push(&body[start..i]);
            if body[i] == b'\r' && body.get(i + 1) == Some(&b'\n') {
                i += 1;
            }
            start = i + 1;
        }
        i += 1;
    }
    // Lines after `start` never ended: not part of the stream's lines.
    let mut out = Vec::new();
    let (mut data, mut event, mut id) = (None::<String>, "", String::new());
    for line in lines {
        let line = std::str::from_utf8(line).unwrap();
        if line.is_empty() {
            if let Some(d) = data.take() {
                out.push(ev(&d, event, &id));
            }
            event = "";
            continue;
        }
        if line.starts_with(':') {
            continue;
        }
        let (f, v) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line, ""),
        };
        match f {
            "data" => match &mut data {
                Some(d) => *d = format!("{d}\n{v}"),
                None => data = Some(v.to_string()),
            },
            "event" => event = v,
            "id" if !v.contains('\0') => id = v.to_string(),
            _ => {}
        }
    }
    out
}

/// Streams made of the pieces the rules treat specially, so that random ones exercise
/// every rule (and their interleavings) often.
fn stream() -> impl Strategy<Value = Vec<u8>> {
    const PIECES: [&[u8]; 16] = [
        b"data",
        b"data:",
        b"data: ",
        b"event: ",
        b"id: ",
        b"retry: 12",
        b":",
        b" ",
        b"\n",
        b"\r",
        b"\r\n",
        b"\n\n",
        b"\0",
        b"x",
        b"\xC3\xA9",
        &BOM,
    ];
    let piece = prop::sample::select(&PIECES[..]);
    (any::<bool>(), prop::collection::vec(piece, 0..60)).prop_map(|(bom, pieces)| {
        let mut s = if bom { BOM.to_vec() } else { Vec::new() };
        for p in pieces {
            s.extend_from_slice(p);
        }
        s
    })
}

/// `body` cut at `cuts` (positions taken modulo its length).
fn split<'a>(body: &'a [u8], cuts: &[usize]) -> Vec<&'a [u8]> {
    let mut at: Vec<usize> = cuts.iter().map(|c| c % (body.len() + 1)).collect();
    at.sort_unstable();
    let mut out = Vec::new();
    let mut prev = 0;
    for c in at.into_iter().chain([body.len()]) {
        out.push(&body[prev..c]);
        prev = c;
    }
    out
}

proptest! {
    /// The events do not depend on where chunks split the stream, and they are the
    /// ones a whole-stream reading of the rules gives.
    #[test]
    fn chunking_never_changes_the_events(
        body in stream(),
        cuts in prop::collection::vec(any::<usize>(), 0..12),
    ) {
        let whole = events(&body, BIG).unwrap();
        prop_assert_eq!(&whole, &oracle(&body));
        prop_assert_eq!(&parse_chunks(&split(&body, &cuts), BIG).unwrap(), &whole);
        let bytes: Vec<&[u8]> = body.chunks(1).collect();
        prop_assert_eq!(&parse_chunks(&bytes, BIG).unwrap(), &whole);
    }

    /// Arbitrary bytes, chunked arbitrarily, never panic and never make the parser
    /// hold more than the cap; whatever they give (events or a refusal), they give
    /// under any chunking.
    #[test]
    fn arbitrary_bytes_stay_within_the_cap(
        body in prop::collection::vec(any::<u8>(), 0..2000),
        cuts in prop::collection::vec(any::<usize>(), 0..12),
        cap in 1u64..300,
    ) {
        // parse_chunks asserts the bound after every call.
        prop_assert_eq!(parse_chunks(&split(&body, &cuts), cap), events(&body, cap));
    }

    /// The same with streams built of the rules' special pieces and a small cap, so
    /// that refusals land on every kind of line.
    #[test]
    fn refusals_do_not_depend_on_chunking(
        body in stream(),
        cuts in prop::collection::vec(any::<usize>(), 0..12),
        cap in 1u64..40,
    ) {
        prop_assert_eq!(parse_chunks(&split(&body, &cuts), cap), events(&body, cap));
    }
}
